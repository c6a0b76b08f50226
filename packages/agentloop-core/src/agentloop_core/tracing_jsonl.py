"""Deprecated: use :mod:`agentloop_core.tracing.jsonl` (removed in the next release).

A thin shim kept one release; every name it exports is the object of the new module.
"""

import warnings

from agentloop_core.tracing.jsonl import JsonlTracer, read_spans

__all__ = ["JsonlTracer", "read_spans"]

warnings.warn(
    "agentloop_core.tracing_jsonl is deprecated and will be removed in the next release; import from "
    "agentloop_core.tracing.jsonl instead (e.g. `from agentloop_core.tracing.jsonl import JsonlTracer`)",
    DeprecationWarning,
    stacklevel=2,
)
