"""agentloop-engines: engine adapters and the load-balancing client."""

from importlib.metadata import version as _distribution_version
from typing import TYPE_CHECKING

from agentloop_engines.base import AsyncServerBase
from agentloop_engines.client import ClientStats, LLMServerClient, NoHealthyReplicaError, RequestTimeoutError
from agentloop_engines.gateway import (
    Gateway,
    GatewayThread,
    RecordedCall,
    SessionNotFoundError,
    SessionRecorder,
    create_gateway_app,
    serve_gateway,
)
from agentloop_engines.hosting import (
    RemoteClient,
    ServerActor,
    client_actor,
    local_client,
    start_replicas,
)
from agentloop_engines.http_server import ServerThread, create_app, serve
from agentloop_engines.routing import StickyLeastInFlightPolicy
from agentloop_engines.streaming import TokenDelta
from agentloop_engines.tiny_model import build_tiny_model

if TYPE_CHECKING:  # resolved lazily at run time, by __getattr__ below
    from agentloop_engines.hf import HFServer
    from agentloop_engines.http_client import RemoteServer
    from agentloop_engines.sglang_server import SGLangServer
    from agentloop_engines.vllm_server import VLLMServer

__version__ = _distribution_version("agentloop-engines")
"""The installed distribution's version: pyproject.toml is its one source."""

__all__ = [
    "__version__",
    "AsyncServerBase", "HFServer", "TokenDelta", "build_tiny_model",
    "ClientStats", "LLMServerClient", "NoHealthyReplicaError", "RequestTimeoutError", "StickyLeastInFlightPolicy",
    "RemoteClient", "ServerActor", "client_actor", "local_client", "start_replicas",
    "ServerThread", "create_app", "serve", "RemoteServer", "SGLangServer", "VLLMServer",
    "Gateway", "GatewayThread", "RecordedCall", "SessionNotFoundError", "SessionRecorder",
    "create_gateway_app", "serve_gateway",
]

# Adapters whose modules need optional deps (httpx, vLLM, SGLang), resolved on first access.
_LAZY = {"RemoteServer": "agentloop_engines.http_client", "SGLangServer": "agentloop_engines.sglang_server",
         "VLLMServer": "agentloop_engines.vllm_server"}


def __getattr__(name: str):
    # HFServer imports torch; load it only when asked so `import agentloop_engines` stays light.
    if name == "HFServer":
        from agentloop_engines.hf import HFServer

        return HFServer
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'agentloop_engines' has no attribute {name!r}")
