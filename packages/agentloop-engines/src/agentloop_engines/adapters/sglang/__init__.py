"""The SGLang engine: ``SGLangServer`` (runs with ``pip install "agentloop-engines[sglang]"``;
importing this module does not import SGLang)."""

from agentloop_engines.adapters.sglang.server import SGLangServer

__all__ = ["SGLangServer"]
