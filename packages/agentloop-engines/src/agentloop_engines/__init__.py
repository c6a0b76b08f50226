"""agentloop-engines: engines behind one token-level API, served over HTTP, routed as a fleet.

One word per thing: an *engine* generates (``AsyncServer``; the adapters ``HFServer``,
``VLLMServer``, ``SGLangServer``), a *replica* is one hosted copy of an engine (in process, a Ray
``ReplicaActor``, or a server reached through ``EngineHTTPClient``), and the *router*
(``LLMServerClient``) spreads requests over replicas. The package is three rooms:

* :mod:`~agentloop_engines.adapters`: the engines (``hf``, ``vllm``, ``sglang``);
* :mod:`~agentloop_engines.serving`: the HTTP engine server and the OpenAI-compatible gateway;
* :mod:`~agentloop_engines.fleet`: the router, its replica calls and weight ledger, the HTTP client
  of a remote engine, and hosting on Ray.

Beside them: :mod:`~agentloop_engines.base` and :mod:`~agentloop_engines.streaming` (what every
engine implements), :mod:`~agentloop_engines.wire` (the HTTP wire formats, both ends),
:mod:`~agentloop_engines.plugins` (the engine plug-in records),
:mod:`~agentloop_engines.cli` (``agentloop-serve``) and :mod:`~agentloop_engines.testing`.
"""

from importlib.metadata import version as _distribution_version
from typing import TYPE_CHECKING

from agentloop_engines.base import AsyncServerBase
from agentloop_engines.fleet.client import (
    ClientStats,
    LLMServerClient,
    NoHealthyReplicaError,
    RequestTimeoutError,
)
from agentloop_engines.fleet.hosting import (
    RemoteClient,
    ReplicaActor,
    client_actor,
    local_client,
    start_replicas,
)
from agentloop_engines.fleet.routing import StickyLeastInFlightPolicy
from agentloop_engines.serving.gateway import (
    Gateway,
    GatewayThread,
    RecordedCall,
    SessionNotFoundError,
    SessionRecorder,
    create_gateway_app,
    serve_gateway,
)
from agentloop_engines.serving.server import ServerThread, create_app, serve
from agentloop_engines.streaming import TokenDelta
from agentloop_engines.testing.tiny_model import build_tiny_model

if TYPE_CHECKING:  # resolved lazily at run time, by __getattr__ below
    from agentloop_engines.adapters.hf import HFServer
    from agentloop_engines.adapters.sglang.server import SGLangServer
    from agentloop_engines.adapters.vllm.server import VLLMServer
    from agentloop_engines.fleet.http_client import EngineHTTPClient

__version__ = _distribution_version("agentloop-engines")
"""The installed distribution's version: pyproject.toml is its one source."""

__all__ = [
    "__version__",
    "AsyncServerBase", "HFServer", "TokenDelta", "build_tiny_model",
    "ClientStats", "LLMServerClient", "NoHealthyReplicaError", "RequestTimeoutError", "StickyLeastInFlightPolicy",
    "RemoteClient", "ReplicaActor", "client_actor", "local_client", "start_replicas",
    "ServerThread", "create_app", "serve", "EngineHTTPClient", "SGLangServer", "VLLMServer",
    "Gateway", "GatewayThread", "RecordedCall", "SessionNotFoundError", "SessionRecorder",
    "create_gateway_app", "serve_gateway",
]

# Adapters whose modules need optional deps (httpx, vLLM, SGLang), resolved on first access.
_LAZY = {"EngineHTTPClient": "agentloop_engines.fleet.http_client", "SGLangServer": "agentloop_engines.adapters.sglang.server",
         "VLLMServer": "agentloop_engines.adapters.vllm.server"}


def __getattr__(name: str):
    # HFServer imports torch; load it only when asked so `import agentloop_engines` stays light.
    if name == "HFServer":
        from agentloop_engines.adapters.hf import HFServer

        return HFServer
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'agentloop_engines' has no attribute {name!r}")
