"""Tool-call parsers, re-exported from :mod:`agentloop_core.parsers` where they live (pure text
in, structured calls out, so the HTTP server in agentloop-engines can return ``tool_calls``
without importing this package). ``agentloop_tools.parsers.<module>`` names the same module
objects as ``agentloop_core.parsers.<module>``, so classes and the registry are shared."""

import importlib
import sys

from agentloop_core.parsers import *  # noqa: F403
from agentloop_core.parsers import __all__  # noqa: F401

for _module in ("base", "registry", "schema_check", "hermes", "llama3_json", "harmony", "mistral", "qwen3_coder"):
    sys.modules[f"{__name__}.{_module}"] = importlib.import_module(f"agentloop_core.parsers.{_module}")
