"""The transformers engine: ``HFServer`` (needs ``pip install "agentloop-engines[hf]"``)."""

from agentloop_engines.adapters.hf.server import HFServer

__all__ = ["HFServer"]
