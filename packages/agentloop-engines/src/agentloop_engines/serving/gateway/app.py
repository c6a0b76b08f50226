"""The gateway over HTTP: OpenAI endpoints, per-session base URLs, and an in-process thread.

Endpoints (JSON). Chat routes need the ``api_key`` when the app has one, as
``Authorization: Bearer <api_key>`` or ``x-api-key: <api_key>``:

* ``POST /v1/chat/completions``, ``POST /v1/completions``, ``GET /v1/models``;
* ``POST /v1/responses`` (OpenAI's Responses API, :mod:`~agentloop_engines.serving.gateway.responses_api`),
  ``POST /v1/messages`` and ``POST /v1/messages/count_tokens`` (Anthropic's Messages API,
  :mod:`~agentloop_engines.serving.gateway.messages_api`): both translate to a chat request, so one
  template, one session recording and the token-exact continuation serve all three APIs;
* the same under a session's base URL, ``/sessions/<session_id>/<session key>/v1/...``: the
  call is recorded in that session. The session key is a secret made when the session is
  opened, so a session is reachable only by whoever got its URL (its trajectory's agent), not
  by anyone who knows its id; the ``X-Agentloop-Session`` header (with
  ``X-Agentloop-Session-Key``) on the plain paths does the same.

Control routes need ``Authorization: Bearer <control_key>`` (the chat key never opens them;
an app without a control key answers them 403; see :mod:`agentloop_engines.serving.control`):

* ``GET /sessions``: open sessions, the limits, and how many session chat calls continued the
  previous call token-exactly or were rendered whole after an edit (``continued_calls``,
  ``restarted_calls``); ``POST /sessions/<id>`` opens one (optional body
  ``{"sampling_params": {...}, "response_length": N}``: overrides for its calls and its
  response budget, fixed from then on: opening an open session is 409) and returns its
  ``base_url`` and ``session_key``; ``GET /sessions/<id>``: its recorded calls;
  ``DELETE /sessions/<id>``: the same, and the session is forgotten (how a remote loop takes a
  trajectory).

``GET /health``: liveness and the model name (no key needed).

Errors use OpenAI's shape ``{"error": {"message", "type", "code"}}`` (on the Messages routes,
Anthropic's ``{"type": "error", "error": {"type", "message"}}``; see :func:`gateway_error_shapes`): 400 for bad input (the
key or value named; template text or a template variable the server does not allow), 401
without the key (from the headers, before the body is read), 403 for a control route without
a control key configured, 404 for a session that is not open or a wrong session key (the same
answer, so the key's holder alone learns more; a control ``GET``/``DELETE`` says which limit
dropped it), 409 for opening an open session, 408 for a body not received within
``body_timeout_s``, 413 for an oversized body or prompt (the limit named), 503 when no engine
replica is left, or with ``Retry-After`` over ``max_in_flight`` (see
:class:`~agentloop_engines.serving.common.ServerLimits` and
:class:`~agentloop_engines.serving.gateway.prompt_limits.PromptLimits`).

A streamed request (``stream: true``) is sent as server-sent events while the engine decodes it
(see :mod:`~agentloop_engines.serving.gateway.live`; the Responses and Messages APIs as their typed
events, ``event: <type>`` lines, with no ``[DONE]``); the first event waits for the engine's first
tokens, so an error still arrives as a plain JSON error before any event. One after it (an
engine failing mid-decode) ends the stream with the API's in-stream error, which its client
raises as an API error (see :mod:`~agentloop_engines.serving.gateway.stream_errors`). A client
that disconnects mid-stream stops the generation.
"""

# No `from __future__ import annotations`: FastAPI resolves the endpoints' annotations.

import re
from collections.abc import Callable, Sequence
from typing import Any
from urllib.parse import quote

from agentloop_engines.serving.common import (
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
from agentloop_engines.serving.control import is_chat_path, new_control_key
from agentloop_engines.serving.error_shapes import ErrorBody, anthropic_error, openai_error
from agentloop_engines.serving.gateway.core import Gateway
from agentloop_engines.serving.gateway.live import stream_chat_completion, stream_completion
from agentloop_engines.serving.gateway.messages_api import count_tokens, create_message
from agentloop_engines.serving.gateway.openai_response import sse_events, sse_live
from agentloop_engines.serving.gateway.recorder import SessionNotFoundError, check_session_id
from agentloop_engines.serving.gateway.responses_api import create_response
from agentloop_engines.serving.gateway.stream_errors import ERRORS

__all__ = ["ANTHROPIC_PATHS", "SESSION_HEADER", "SESSION_KEY_HEADER", "GatewayThread", "add_gateway_routes",
           "create_gateway_app", "gateway_error_shapes", "serve_gateway", "session_base_path"]

SESSION_HEADER = "X-Agentloop-Session"
"""Header naming the session of a call made on the plain ``/v1/...`` paths."""
SESSION_KEY_HEADER = "X-Agentloop-Session-Key"
"""Header carrying that session's key (what a session URL carries as its path segment)."""



ANTHROPIC_PATHS = re.compile(r"(?:/sessions/[^/]+(?:/[^/]+)?)?/v1/messages(?:/count_tokens)?")
"""The routes of Anthropic's API, whose errors are in Anthropic's shape (full match)."""


def gateway_error_shapes(path: str) -> ErrorBody:
    """The error body of a gateway path: Anthropic's on its Messages routes, else OpenAI's."""
    return anthropic_error if ANTHROPIC_PATHS.fullmatch(path) else openai_error


def session_base_path(session_id: str, session_key: str) -> str:
    """The base URL path of a session: ``/sessions/<id>/<session key>/v1``."""
    return f"/sessions/{quote(check_session_id(session_id))}/{quote(session_key, safe='')}/v1"


def _session(path: tuple[str, str] | None, header_id: str | None,
             header_key: str | None) -> tuple[str | None, str | None]:
    """``(session id, session key)`` of a call, from its URL or its headers."""
    if path is not None:
        if header_id is not None and header_id != path[0]:
            raise ValueError(f"the URL names session {path[0]!r} but the {SESSION_HEADER} header names "
                             f"{header_id!r}; use one of them")
        return check_session_id(path[0]), path[1]
    if header_id is None:
        if header_key is not None:
            raise ValueError(f"a {SESSION_KEY_HEADER} header without {SESSION_HEADER}; send both, or neither")
        return None, None
    if header_key is None:
        raise SessionNotFoundError(f"the {SESSION_HEADER} header names session {header_id!r} without its key; send "
                                   f"the session key too ({SESSION_KEY_HEADER}), or call the session's own base URL")
    return check_session_id(header_id), header_key


def _no_session(path: tuple[str, str] | None, header_id: str | None, header_key: str | None) -> tuple[None, None]:
    if header_id is not None or header_key is not None:
        raise ValueError(f"the {SESSION_HEADER} header names session {header_id!r}, but this server records no "
                         "sessions (an engine server started without a gateway); serve the engine with "
                         "gateway=Gateway(engine, tokenizer) (as `agentloop serve` does), or leave the header out")
    return None, None


def _sessions_body(session_id: str, calls: list[Any]) -> dict[str, Any]:
    return {"session_id": session_id, "num_calls": len(calls), "calls": [c.as_dict() for c in calls]}


def add_gateway_routes(app: Any, gateway: Gateway, auth: Sequence[Any] = (), *, sessions: bool = True) -> None:
    """Add the gateway's endpoints (not ``/health``) to a FastAPI ``app``.

    Args:
        app: The FastAPI app (error handlers installed with
            :func:`~agentloop_engines.serving.common.install_error_handlers`), to be served behind a
            :class:`~agentloop_engines.serving.common.RequestGuard`, which authenticates requests
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
            return error_response(status, str(exc), code, gateway_error_shapes(request.url.path))

        app.add_exception_handler(exc_type, handler)

    def live(chunks: Any, events: Any = sse_live) -> Any:
        return StreamingResponse(events(chunks), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    async def answer_chat(body: dict[str, Any], sid: str | None, skey: str | None) -> Any:
        if body.get("stream") is True:
            return live(await stream_chat_completion(gateway, body, session_id=sid, session_key=skey))
        return (await gateway.chat_completion(body, session_id=sid, session_key=skey)).body

    async def answer_completion(body: dict[str, Any], sid: str | None, skey: str | None) -> Any:
        if body.get("stream") is True:
            return live(await stream_completion(gateway, body, session_id=sid, session_key=skey))
        return (await gateway.completion(body, session_id=sid, session_key=skey)).body

    async def answer_response(body: dict[str, Any], sid: str | None, skey: str | None) -> Any:
        result = await create_response(gateway, body, session_id=sid, session_key=skey)
        return result if isinstance(result, dict) else live(result, sse_events)

    async def answer_message(body: dict[str, Any], sid: str | None, skey: str | None) -> Any:
        result = await create_message(gateway, body, session_id=sid, session_key=skey)
        return result if isinstance(result, dict) else live(result, sse_events)

    async def answer_count(body: dict[str, Any], sid: str | None, skey: str | None) -> Any:
        return await count_tokens(gateway, body, session_id=sid, session_key=skey)

    header = fastapi.Header(default=None, alias=SESSION_HEADER)
    key_header = fastapi.Header(default=None, alias=SESSION_KEY_HEADER)
    plain_session = _session if sessions else _no_session

    # Two endpoints per route: on the plain paths a session_id parameter would otherwise become
    # a query parameter, a third, undocumented way to name a session.
    def plain(answer: Callable[..., Any]) -> Callable[..., Any]:
        async def endpoint(body: dict[str, Any], session: str | None = header, key: str | None = key_header) -> Any:
            return await answer(body, *plain_session(None, session, key))
        return endpoint

    def in_session(answer: Callable[..., Any]) -> Callable[..., Any]:
        async def endpoint(session_id: str, session_key: str, body: dict[str, Any], session: str | None = header,
                           key: str | None = key_header) -> Any:
            return await answer(body, *_session((session_id, session_key), session, key))
        return endpoint

    async def models() -> dict[str, Any]:
        return gateway.models()

    async def session_models(session_id: str, session_key: str) -> dict[str, Any]:
        gateway.recorder.authorize(check_session_id(session_id), session_key)
        return gateway.models()

    async def keyless(session_id: str) -> None:
        raise SessionNotFoundError(
            f"/sessions/{session_id}/v1 has no session key: a session's base URL is /sessions/<id>/<session key>/v1, "
            "as returned by POST /sessions/<id> (control key) or GatewayThread.session_url; the id alone reaches "
            "no session")

    posts = {"chat/completions": answer_chat, "completions": answer_completion, "responses": answer_response,
             "messages": answer_message, "messages/count_tokens": answer_count}
    for route, answer in posts.items():
        app.add_api_route(f"/v1/{route}", plain(answer), methods=["POST"], dependencies=auth)
        if sessions:
            app.add_api_route(f"/sessions/{{session_id}}/{{session_key}}/v1/{route}", in_session(answer),
                              methods=["POST"], dependencies=auth)
            app.add_api_route(f"/sessions/{{session_id}}/v1/{route}", keyless, methods=["POST"], dependencies=auth)
    app.add_api_route("/v1/models", models, methods=["GET"], dependencies=auth)
    if sessions:
        app.add_api_route("/sessions/{session_id}/{session_key}/v1/models", session_models, methods=["GET"],
                          dependencies=auth)
        app.add_api_route("/sessions/{session_id}/v1/models", keyless, methods=["GET"], dependencies=auth)
    if sessions:
        _add_session_routes(app, gateway, auth)


def _add_session_routes(app: Any, gateway: Gateway, auth: list[Any]) -> None:
    # Control routes: the guard admits them with the control key only (agentloop_engines.serving.control).
    @app.get("/sessions", dependencies=auth)
    async def list_sessions() -> dict[str, Any]:
        rec = gateway.recorder
        return {"sessions": rec.session_ids(), "max_sessions": rec.max_sessions, "ttl_s": rec.ttl_s,
                "max_calls_per_session": rec.max_calls_per_session, "evicted": rec.evicted, "expired": rec.expired,
                "continued_calls": gateway.continued_calls, "restarted_calls": gateway.restarted_calls}

    @app.post("/sessions/{session_id}", dependencies=auth)
    async def open_session(session_id: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        body = body or {}
        unknown = sorted(set(body) - {"sampling_params", "response_length"})
        if unknown:
            raise ValueError(f"unsupported key(s) {unknown} to open a session; send "
                             "{\"sampling_params\": {...}, \"response_length\": N} (both optional)")
        overrides = body.get("sampling_params")
        if overrides is not None and not isinstance(overrides, dict):
            raise ValueError("'sampling_params' must be an object of sampling parameters")
        key = gateway.open_session(session_id, sampling_overrides=overrides,
                                   response_length=body.get("response_length"))
        # The key goes to the opener only; it hands the base URL to the one agent it is for.
        return {"session_id": session_id, "base_url": session_base_path(session_id, key), "session_key": key}

    @app.get("/sessions/{session_id}", dependencies=auth)
    async def get_session(session_id: str) -> dict[str, Any]:
        return _sessions_body(session_id, gateway.recorder.get(session_id))

    @app.delete("/sessions/{session_id}", dependencies=auth)
    async def delete_session(session_id: str) -> dict[str, Any]:
        return _sessions_body(session_id, gateway.close_session(session_id))


def create_gateway_app(gateway: Gateway, *, api_key: str | None = None,
                       max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES, limits: ServerLimits | None = None,
                       control_key: str | None = None) -> Any:
    """Build the ASGI app serving ``gateway`` (the endpoints in this module's docstring).

    What a request may make the gateway render is ``gateway.prompt_limits``.

    Args:
        gateway: The gateway.
        api_key: When set, every chat endpoint needs ``Authorization: Bearer <key>``.
        max_request_bytes: Larger request bodies get 413.
        limits: In-flight limit and body deadline (see
            :class:`~agentloop_engines.serving.common.ServerLimits`); None: the defaults.
        control_key: The bearer token of the session admin routes; None: they answer 403.

    Returns:
        A FastAPI application wrapped in the :class:`~agentloop_engines.serving.common.RequestGuard`.

    Raises:
        ImportError: without the ``[server]`` extra.
        ValueError: on a non-positive body limit, an empty ``api_key``, or a ``control_key`` that
            is empty or equals ``api_key``.
    """
    fastapi, _ = require_server_extra()
    app = fastapi.FastAPI(title="agentloop gateway", docs_url=None, redoc_url=None, openapi_url=None)
    install_error_handlers(app, error_shapes=gateway_error_shapes)
    add_gateway_routes(app, gateway)

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "gateway": True, "model": gateway.model_name,
                "engine": type(gateway.server).__name__}

    return RequestGuard(app, api_key=api_key, max_bytes=max_request_bytes, limits=limits or ServerLimits(),
                        control_key=control_key, is_chat=is_chat_path, error_shapes=gateway_error_shapes)


def serve_gateway(gateway: Gateway, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None, *,
                  max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES, log_level: str = "info",
                  limits: ServerLimits | None = None, control_key: str | None = None) -> None:
    """Serve ``gateway`` with uvicorn until interrupted (blocks). Loopback by default; the
    arguments are :func:`create_gateway_app`'s (``limits`` also sets uvicorn's connection limits)."""
    _, uvicorn = require_server_extra()
    warn_if_exposed(host, api_key)
    limits = limits or ServerLimits()
    app = create_gateway_app(gateway, api_key=api_key, max_request_bytes=max_request_bytes, limits=limits,
                             control_key=control_key)
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
        control_key: See :func:`create_gateway_app`; None: a fresh random one
            (:attr:`control_key`), so only the code that started the thread administers sessions.
    """

    def __init__(self, gateway: Gateway, host: str = "127.0.0.1", port: int = 0, api_key: str | None = None, *,
                 max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES, start_timeout_s: float = 30.0,
                 limits: ServerLimits | None = None, control_key: str | None = None) -> None:
        warn_if_exposed(host, api_key)
        self.control_key = control_key if control_key is not None else new_control_key()
        """The session admin routes' bearer token; never give it to an agent."""
        app = create_gateway_app(gateway, api_key=api_key, max_request_bytes=max_request_bytes, limits=limits,
                                 control_key=self.control_key)
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
        (``http://127.0.0.1:40123/sessions/<id>/<session key>/v1``): give it to that session's
        agent only. A session that is not open is opened (no overrides, no budget); open it
        with ``gateway.open_session`` first to set them."""
        key = self.gateway.recorder.key(check_session_id(session_id), create=True)
        return f"{self.url}{session_base_path(session_id, key)}"
