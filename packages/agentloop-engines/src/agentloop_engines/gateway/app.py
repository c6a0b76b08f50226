"""The gateway over HTTP: OpenAI endpoints, per-session base URLs, and an in-process thread.

Endpoints (JSON; every one but ``/health`` needs ``Authorization: Bearer <api_key>`` when the
app has one):

* ``POST /v1/chat/completions``, ``POST /v1/completions``, ``GET /v1/models``;
* the same under ``/sessions/<session_id>/v1/...``: the call is recorded in that session (so
  a trajectory's base URL is ``http://host:port/sessions/<id>/v1``); a ``X-Agentloop-Session``
  header on the plain paths does the same;
* ``GET /sessions``: open sessions, the limits, and how many session chat calls continued the
  previous call token-exactly or were rendered whole after an edit (``continued_calls``,
  ``restarted_calls``); ``POST /sessions/<id>`` opens one
  (optional body ``{"sampling_params": {...}}``: overrides for its calls);
  ``GET /sessions/<id>``: its recorded calls; ``DELETE /sessions/<id>``: the same, and the
  session is forgotten (how a remote loop takes a trajectory);
* ``GET /health``: liveness and the model name (no key needed).

Errors use OpenAI's shape ``{"error": {"message", "type", "code"}}``: 400 for bad input (the
key or value named; template text or a template variable the server does not allow), 401
without the key (from the headers, before the body is read), 404 for an unknown or dropped
session (the message says which limit dropped it), 408 for a body not received within
``body_timeout_s``, 413 for an oversized body or prompt (the limit named), 503 when no engine
replica is left, or with ``Retry-After`` over ``max_in_flight`` (see
:class:`~agentloop_engines.http_common.ServerLimits` and
:class:`~agentloop_engines.gateway.prompt_limits.PromptLimits`).

A streamed request (``stream: true``) is generated whole, then sent as server-sent events, so
an error still arrives as a plain JSON error before any event.
"""

# No `from __future__ import annotations`: FastAPI resolves the endpoints' annotations.

from collections.abc import Callable, Sequence
from typing import Any
from urllib.parse import quote

from agentloop_engines.gateway.core import Gateway
from agentloop_engines.gateway.openai_response import GatewayResponse, sse
from agentloop_engines.gateway.prompt_limits import PromptLimitError
from agentloop_engines.gateway.recorder import SessionCallLimitError, SessionNotFoundError, check_session_id
from agentloop_engines.http_common import (
    DEFAULT_MAX_REQUEST_BYTES,
    RequestGuard,
    ServerLimits,
    UvicornThread,
    error_response,
    install_error_handlers,
    require_server_extra,
    uvicorn_config,
    warn_if_exposed,
)
from agentloop_engines.routing import NoHealthyReplicaError, RequestTimeoutError

__all__ = ["SESSION_HEADER", "GatewayThread", "add_gateway_routes", "create_gateway_app", "serve_gateway"]

SESSION_HEADER = "X-Agentloop-Session"
"""Header naming the session of a call made on the plain ``/v1/...`` paths."""

ERRORS = {
    SessionNotFoundError: (404, "session_not_found"),
    SessionCallLimitError: (400, "session_call_limit"),
    PromptLimitError: (413, "request_too_large"),
    NoHealthyReplicaError: (503, "engine_unavailable"),
    RequestTimeoutError: (504, "engine_timeout"),
}


def _session(path_id: str | None, header_id: str | None) -> str | None:
    if path_id is not None and header_id is not None and header_id != path_id:
        raise ValueError(f"the URL names session {path_id!r} but the {SESSION_HEADER} header names "
                         f"{header_id!r}; use one of them")
    session_id = path_id if path_id is not None else header_id
    return None if session_id is None else check_session_id(session_id)


def _no_session(path_id: str | None, header_id: str | None) -> None:
    if header_id is not None:
        raise ValueError(f"the {SESSION_HEADER} header names session {header_id!r}, but this server records no "
                         "sessions (an engine server started without a gateway); serve the engine with "
                         "gateway=Gateway(engine, tokenizer) (as `agentloop serve` does), or leave the header out")


def _sessions_body(session_id: str, calls: list[Any]) -> dict[str, Any]:
    return {"session_id": session_id, "num_calls": len(calls), "calls": [c.as_dict() for c in calls]}


def add_gateway_routes(app: Any, gateway: Gateway, auth: Sequence[Any] = (), *, sessions: bool = True) -> None:
    """Add the gateway's endpoints (not ``/health``) to a FastAPI ``app``.

    Args:
        app: The FastAPI app (error handlers installed with
            :func:`~agentloop_engines.http_common.install_error_handlers`), to be served behind a
            :class:`~agentloop_engines.http_common.RequestGuard`, which authenticates requests
            before their body is read.
        gateway: The gateway to serve.
        auth: FastAPI dependencies every endpoint takes (an app's own checks; the bearer check
            is the guard's).
        sessions: Also serve the session endpoints (``/sessions/...`` and the
            ``X-Agentloop-Session`` header). False: only the plain ``/v1/...`` paths, and a
            request naming a session is a 400 (nothing would record it), which is how an
            engine server without a gateway of its own serves ``/v1``.
    """
    auth = list(auth)
    fastapi, _ = require_server_extra()
    from fastapi.responses import StreamingResponse

    for exc_type, (status, code) in ERRORS.items():
        async def handler(request: Any, exc: BaseException, status: int = status, code: str = code) -> Any:
            return error_response(status, str(exc), code)

        app.add_exception_handler(exc_type, handler)

    def reply(response: GatewayResponse) -> Any:
        if not response.stream:
            return response.body
        return StreamingResponse(sse(iter(response.chunks())), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})

    header = fastapi.Header(default=None, alias=SESSION_HEADER)
    plain_session = _session if sessions else _no_session

    # Two functions per endpoint: on the plain paths a session_id parameter would otherwise
    # become a query parameter, a third, undocumented way to name a session.
    async def chat(body: dict[str, Any], session: str | None = header) -> Any:
        return reply(await gateway.chat_completion(body, session_id=plain_session(None, session)))

    async def session_chat(session_id: str, body: dict[str, Any], session: str | None = header) -> Any:
        return reply(await gateway.chat_completion(body, session_id=_session(session_id, session)))

    async def completions(body: dict[str, Any], session: str | None = header) -> Any:
        return reply(await gateway.completion(body, session_id=plain_session(None, session)))

    async def session_completions(session_id: str, body: dict[str, Any], session: str | None = header) -> Any:
        return reply(await gateway.completion(body, session_id=_session(session_id, session)))

    async def models() -> dict[str, Any]:
        return gateway.models()

    async def session_models(session_id: str) -> dict[str, Any]:
        return gateway.models()

    # Plain and per-session endpoints differ in their path parameter, so the list holds either.
    mounted: list[tuple[str, tuple[Callable[..., Any], ...]]] = [("", (chat, completions, models))]
    if sessions:
        mounted.append(("/sessions/{session_id}", (session_chat, session_completions, session_models)))
    for prefix, endpoints in mounted:
        app.add_api_route(f"{prefix}/v1/chat/completions", endpoints[0], methods=["POST"], dependencies=auth)
        app.add_api_route(f"{prefix}/v1/completions", endpoints[1], methods=["POST"], dependencies=auth)
        app.add_api_route(f"{prefix}/v1/models", endpoints[2], methods=["GET"], dependencies=auth)
    if sessions:
        _add_session_routes(app, gateway, auth)


def _add_session_routes(app: Any, gateway: Gateway, auth: list[Any]) -> None:
    @app.get("/sessions", dependencies=auth)
    async def list_sessions() -> dict[str, Any]:
        rec = gateway.recorder
        return {"sessions": rec.session_ids(), "max_sessions": rec.max_sessions, "ttl_s": rec.ttl_s,
                "max_calls_per_session": rec.max_calls_per_session, "evicted": rec.evicted, "expired": rec.expired,
                "continued_calls": gateway.continued_calls, "restarted_calls": gateway.restarted_calls}

    @app.post("/sessions/{session_id}", dependencies=auth)
    async def open_session(session_id: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        body = body or {}
        unknown = sorted(set(body) - {"sampling_params"})
        if unknown:
            raise ValueError(f"unsupported key(s) {unknown} to open a session; send {{\"sampling_params\": {{...}}}}")
        overrides = body.get("sampling_params")
        if overrides is not None and not isinstance(overrides, dict):
            raise ValueError("'sampling_params' must be an object of sampling parameters")
        gateway.open_session(session_id, sampling_overrides=overrides)
        return {"session_id": session_id, "base_url": f"/sessions/{quote(session_id)}/v1"}

    @app.get("/sessions/{session_id}", dependencies=auth)
    async def get_session(session_id: str) -> dict[str, Any]:
        return _sessions_body(session_id, gateway.recorder.get(session_id))

    @app.delete("/sessions/{session_id}", dependencies=auth)
    async def delete_session(session_id: str) -> dict[str, Any]:
        return _sessions_body(session_id, gateway.close_session(session_id))


def create_gateway_app(gateway: Gateway, *, api_key: str | None = None,
                       max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES, limits: ServerLimits | None = None) -> Any:
    """Build the ASGI app serving ``gateway`` (the endpoints in this module's docstring).

    What a request may make the gateway render is ``gateway.prompt_limits``.

    Args:
        gateway: The gateway.
        api_key: When set, every endpoint but ``/health`` needs ``Authorization: Bearer <key>``.
        max_request_bytes: Larger request bodies get 413.
        limits: In-flight limit and body deadline (see
            :class:`~agentloop_engines.http_common.ServerLimits`); None: the defaults.

    Returns:
        A FastAPI application wrapped in the :class:`~agentloop_engines.http_common.RequestGuard`.

    Raises:
        ImportError: without the ``[server]`` extra.
        ValueError: on a non-positive body limit or an empty ``api_key``.
    """
    fastapi, _ = require_server_extra()
    app = fastapi.FastAPI(title="agentloop gateway", docs_url=None, redoc_url=None, openapi_url=None)
    install_error_handlers(app)
    add_gateway_routes(app, gateway)

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "gateway": True, "model": gateway.model_name,
                "engine": type(gateway.server).__name__}

    return RequestGuard(app, api_key=api_key, max_bytes=max_request_bytes, limits=limits or ServerLimits())


def serve_gateway(gateway: Gateway, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None, *,
                  max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES, log_level: str = "info",
                  limits: ServerLimits | None = None) -> None:
    """Serve ``gateway`` with uvicorn until interrupted (blocks). Loopback by default; the
    arguments are :func:`create_gateway_app`'s (``limits`` also sets uvicorn's connection limits)."""
    _, uvicorn = require_server_extra()
    warn_if_exposed(host, api_key)
    limits = limits or ServerLimits()
    app = create_gateway_app(gateway, api_key=api_key, max_request_bytes=max_request_bytes, limits=limits)
    uvicorn.Server(uvicorn_config(app, host, port, limits, log_level)).run()


class GatewayThread(UvicornThread):
    """Run a gateway in a background thread; a context manager.

    A rollout loop starts one around its server client and gives each trajectory
    :meth:`session_url`. When the server lives on another event loop (the loop running the
    rollout), build the gateway with ``server_loop=`` that loop.

    ``port=0`` picks a free port; read the address from :attr:`url` after entering.

    Args:
        gateway: The gateway to serve.
        host: Bind address.
        port: TCP port, 0 for any free one.
        api_key: See :func:`create_gateway_app`.
        max_request_bytes: See :func:`create_gateway_app`.
        start_timeout_s: How long to wait for the socket to listen.
        limits: See :func:`create_gateway_app`; also uvicorn's connection settings.
    """

    def __init__(self, gateway: Gateway, host: str = "127.0.0.1", port: int = 0, api_key: str | None = None, *,
                 max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES, start_timeout_s: float = 30.0,
                 limits: ServerLimits | None = None) -> None:
        warn_if_exposed(host, api_key)
        app = create_gateway_app(gateway, api_key=api_key, max_request_bytes=max_request_bytes, limits=limits)
        super().__init__(app, host, port, start_timeout_s=start_timeout_s, limits=limits)
        self.gateway = gateway

    def __enter__(self) -> "GatewayThread":
        return super().__enter__()

    @property
    def base_url(self) -> str:
        """The OpenAI base URL without a session, e.g. ``http://127.0.0.1:40123/v1``."""
        return f"{self.url}/v1"

    def session_url(self, session_id: str) -> str:
        """The OpenAI base URL whose calls are recorded in ``session_id``
        (``http://127.0.0.1:40123/sessions/<id>/v1``)."""
        return f"{self.url}/sessions/{quote(check_session_id(session_id))}/v1"
