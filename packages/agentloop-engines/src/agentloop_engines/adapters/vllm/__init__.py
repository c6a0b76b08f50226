"""The vLLM engine: ``VLLMServer`` (runs with ``pip install "agentloop-engines[vllm]"``; importing
this module does not import vLLM)."""

from agentloop_engines.adapters.vllm.server import VLLMServer

__all__ = ["VLLMServer"]
