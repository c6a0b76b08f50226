"""What every agentloop HTTP app shares: the ``[server]`` extra check, the request guard (auth,
in-flight limit, body size and body deadline, cancelling a request whose client went away),
errors in each API's shape (:mod:`~agentloop_engines.serving.error_shapes`), the header and write
deadlines of each connection, and running uvicorn in a background thread.

Used by the engine server (:mod:`agentloop_engines.serving.server`) and the OpenAI-compatible
gateway (:mod:`agentloop_engines.serving.gateway`), so both answer auth, size and input errors the
same way: ``{"error": {"message", "type", "code"}}`` (the gateway's Anthropic routes in
Anthropic's shape). Chat paths take the API key as ``Authorization: Bearer <key>`` or, as the
``anthropic`` SDK sends it, ``x-api-key: <key>``.

The guard is ASGI middleware, not FastAPI dependencies, because its order matters: a request
is authenticated and admitted from its headers alone, before one byte of its body is read (a
dependency runs only after FastAPI has read the whole body), and the body is then read against
a deadline (uvicorn has no body timeout: a client that stalls or trickles its body would hold
the request forever).
"""

import asyncio
import hmac
import json
import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from agentloop_core.protocol import CapabilityNotSupportedError
from agentloop_engines.serving.control import check_control_key
from agentloop_engines.serving.error_shapes import ErrorBody, ErrorShapes, openai_error, openai_everywhere
from agentloop_engines.serving.watch import header_deadline_protocol, serve_until_gone

logger = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_MAX_REQUEST_BYTES",
    "RequestGuard",
    "ServerLimits",
    "UvicornThread",
    "error_response",
    "install_error_handlers",
    "require_server_extra",
    "uvicorn_config",
    "warn_if_exposed",
]

DEFAULT_MAX_REQUEST_BYTES = 8 * 2**20
"""8 MiB: a 128k-token prompt as JSON ids is ~1 MiB, so this leaves room without inviting abuse."""

LOOPBACK = {"127.0.0.1", "localhost", "::1"}
OPEN_PATHS = frozenset({"/health"})
"""Paths served without the API key and outside the in-flight limit, so probes always work."""
RETRY_AFTER_S = 1
"""``Retry-After`` of a 503 over the in-flight limit: requests finish in seconds, not minutes."""
LINGER_S = 2.0
"""How long a refused request's unread body is dropped before the connection closes (see :func:`refuse`)."""


@dataclass(frozen=True)
class ServerLimits:
    """How much of the server one client may hold: connections, requests in flight, and time.

    The defaults suit a trainer's rollout on one host (hundreds of concurrent agent calls);
    lower ``max_in_flight`` on a server shared with people, raise it for bigger rollouts.
    """

    max_in_flight: int = 1024
    """Requests served at once (every path but ``/health``); the next one gets 503 with
    ``Retry-After`` at once instead of queueing without bound."""
    body_timeout_s: float = 30.0
    """Seconds from a request's headers to the last byte of its body; a client that stalls or
    trickles its body gets 408 and is disconnected."""
    weights_body_timeout_s: float = 900.0
    """The same for the engine server's ``/update_weights`` (gigabytes: 16 GiB at 20 MB/s)."""
    header_timeout_s: float = 10.0
    """Seconds from the first byte of a request head to its last; slower is disconnected (a head
    sent a line at a time, slowloris). The clock starts at that first byte, not at connect or at
    the last response, so a client that is slow to start (a starved process, a pooled connection
    it opened early) loses nothing; silence is ``first_byte_timeout_s``'s and
    ``keep_alive_timeout_s``'s to bound."""
    first_byte_timeout_s: float = 60.0
    """Seconds a new connection may send nothing at all before it is closed (uvicorn times only
    idle keep-alive connections, so without it a silent connection would be held forever)."""
    write_timeout_s: float = 30.0
    """Seconds a connection's answer may go unread (the client reads nothing while the server's
    send buffers are full); past it the connection is aborted, which frees its in-flight slot
    and the buffered answer. A client must keep reading, not just stay connected."""
    keep_alive_timeout_s: int = 60
    """Seconds an idle keep-alive connection stays open (uvicorn's ``timeout_keep_alive``).
    Longer than clients' own idle expiry (httpx, so the openai client and the trainer's
    ``EngineHTTPClient``: 5 s) on purpose: the client drops an idle connection first, instead of
    sending a request onto one the server is closing at that moment, which it would see as a
    reset. uvicorn's own default, 5 s, equals httpx's, and a client whose process is busy
    (its idle clock starts when it has read the answer, after the server's) loses that race."""
    max_connections: int | None = None
    """Open connections at most (uvicorn's ``limit_concurrency``): past it uvicorn answers every
    request 503, ``/health`` included, so it must exceed ``max_in_flight``. None: twice
    ``max_in_flight``, at least 2048."""
    max_header_bytes: int = 64 * 1024
    """Most bytes of a request head held while it is incomplete (uvicorn's
    ``h11_max_incomplete_event_size``); past it, 400. A head that arrives whole in one read
    (asyncio reads up to 256 KiB) is parsed whatever its size."""

    def __post_init__(self) -> None:
        if self.max_connections is None:
            object.__setattr__(self, "max_connections", max(2048, 2 * self.max_in_flight))
        for name in ("max_in_flight", "body_timeout_s", "weights_body_timeout_s", "header_timeout_s",
                     "first_byte_timeout_s", "write_timeout_s", "keep_alive_timeout_s", "max_connections", "max_header_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"ServerLimits.{name} must be positive, got {value!r}")
        if self.max_connections <= self.max_in_flight:  # type: ignore[operator]
            raise ValueError(f"ServerLimits.max_connections ({self.max_connections}) must exceed max_in_flight "
                             f"({self.max_in_flight}): past it uvicorn answers /health 503 too")


def require_server_extra() -> tuple[Any, Any]:
    """``(fastapi, uvicorn)``, or an ImportError naming the extra to install."""
    try:
        import fastapi
        import uvicorn
    except ImportError as exc:
        raise ImportError(
            f'the HTTP server needs {exc.name}: pip install "agentloop-engines[server]"'
        ) from exc
    return fastapi, uvicorn


def warn_if_exposed(host: str, api_key: str | None, what: str = "generate") -> None:
    if host not in LOOPBACK and api_key is None:
        logger.warning("serving on %s without an api_key: anyone who can reach it can %s", host, what)


def uvicorn_config(app: Any, host: str, port: int, limits: ServerLimits, log_level: str = "info") -> Any:
    """uvicorn's ``Config`` for ``app`` with ``limits``' connection settings."""
    _, uvicorn = require_server_extra()
    return uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=False,
                          http=header_deadline_protocol(limits.header_timeout_s, limits.first_byte_timeout_s,
                                                        limits.write_timeout_s),
                          timeout_keep_alive=limits.keep_alive_timeout_s, limit_concurrency=limits.max_connections,
                          h11_max_incomplete_event_size=limits.max_header_bytes)


class RequestGuard:
    """ASGI middleware run before the app on every path but ``/health``, in this order:

    1. auth from the headers (401, body unread, connection closed): the ``api_key`` on chat
       paths (bearer or ``x-api-key``), the ``control_key`` (bearer) on every other path (403 when there is none; see
       :mod:`agentloop_engines.serving.control`);
    2. one request at a time on the ``one_at_a_time`` paths (409, body unread);
    3. the in-flight limit (503 with ``Retry-After``, body unread);
    4. the body size, by ``Content-Length`` and then by counting (413);
    5. the body deadline, ``body_timeout_s`` from the headers to the last byte (408).

    The body is buffered here and replayed to the app, so the app never reads a body the
    guard has not admitted; a request whose client disconnects before its answer is complete
    is cancelled (:func:`~agentloop_engines.serving.watch.serve_until_gone`), which stops its
    generation and frees its slot.

    Args:
        app: The wrapped ASGI app.
        api_key: The bearer token every guarded request needs; None: no auth.
        max_bytes: The body limit of every path not in ``per_path``.
        limits: In-flight limit and body deadline.
        per_path: ``{path: (limit, setting name, body deadline)}`` for paths with their own
            limits (the engine server's ``/update_weights``: a model's weights are gigabytes, and
            raising every path's limit to that would let any request pin that much memory).
        control_key: The bearer token of the control paths; None: they are refused (403).
        is_chat: Which paths are chat paths (the ``api_key``'s); None: every guarded path (no
            control paths). The apps pass :func:`agentloop_engines.serving.control.is_chat_path`.
        one_at_a_time: Paths served one request at a time; another request arriving meanwhile
            gets 409 from its headers (the engine server's ``/update_weights``, so two uploads
            never hold two bodies of weights).
        error_shapes: The error body of each path (the gateway answers ``/v1/messages`` in
            Anthropic's shape); None: OpenAI's everywhere.

    Raises:
        ValueError: on an empty ``api_key`` (pass None to disable auth), a ``control_key`` that is
            empty or equals ``api_key``, or a non-positive limit.
    """

    def __init__(self, app: Any, *, api_key: str | None, max_bytes: int, limits: ServerLimits,
                 per_path: Mapping[str, tuple[int, str, float]] | None = None, control_key: str | None = None,
                 is_chat: Callable[[str], bool] | None = None, one_at_a_time: Iterable[str] = (),
                 error_shapes: ErrorShapes | None = None) -> None:
        if api_key is not None and not api_key:
            raise ValueError("api_key is an empty string; pass None to disable auth or a real secret")
        check_control_key(control_key, api_key)
        if max_bytes <= 0:
            raise ValueError(f"max_request_bytes must be positive, got {max_bytes}")
        self.app = app
        self.max_bytes = max_bytes
        self.limits = limits
        self.per_path = dict(per_path or {})
        self._expected = None if api_key is None else f"Bearer {api_key}".encode()
        self._api_key = None if api_key is None else api_key.encode()
        self._shapes = error_shapes or openai_everywhere
        self._control = None if control_key is None else f"Bearer {control_key}".encode()
        self._is_chat = is_chat
        self.one_at_a_time = frozenset(one_at_a_time)
        self._busy: set[str] = set()
        self.in_flight = 0
        """Guarded requests being served now (one event loop, so a plain counter)."""

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope.get("path", "") in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers", []))
        path = scope.get("path", "")
        shape = self._shapes(path)
        refusal = self._auth_refusal(path, headers.get(b"authorization", b""), headers.get(b"x-api-key"))
        if refusal is not None:
            await refuse(receive, send, *refusal, shape=shape)
            return
        exclusive = path in self.one_at_a_time
        if exclusive and path in self._busy:
            await refuse(receive, send, 409, f"another {scope.get('method', 'POST')} {path} is in progress; these "
                         "requests are served one at a time (so their bodies are never held together): retry when "
                         "it has finished", "conflict", shape=shape)
            return
        if self.in_flight >= self.limits.max_in_flight:
            await refuse(receive, send, 503, f"the server is serving {self.in_flight} requests, its limit "
                         f"(max_in_flight={self.limits.max_in_flight}); retry after {RETRY_AFTER_S}s, or raise "
                         "ServerLimits(max_in_flight=...) on the server", "server_busy",
                         [(b"retry-after", str(RETRY_AFTER_S).encode())], shape=shape)
            return
        self.in_flight += 1
        if exclusive:
            self._busy.add(path)
        try:
            body = await self._read_body(scope, headers, receive, send, shape)
            if body is not None:
                await serve_until_gone(self.app, scope, body, receive, send)
        finally:
            self.in_flight -= 1
            if exclusive:
                self._busy.discard(path)

    def _auth_refusal(self, path: str, header: bytes,
                      api_key_header: bytes | None) -> tuple[int, str, str, list[tuple[bytes, bytes]]] | None:
        """``(status, message, code, headers)`` refusing the request, or None to admit it."""
        challenge = [(b"www-authenticate", b"Bearer")]
        if self._is_chat is None or self._is_chat(path):
            if self._expected is None or _bearer_ok(header, self._expected):
                return None
            if self._api_key is not None and api_key_header is not None and hmac.compare_digest(
                    api_key_header.strip(), self._api_key):
                return None
            return (401, "missing or invalid API key; send 'Authorization: Bearer <key>' (or 'x-api-key: <key>')",
                    "unauthorized", challenge)
        if self._control is None:
            return (403, f"{path} is a control route (it changes or reads the trainer's state), and this server was "
                    "started without a control key, so it serves none; start it with control_key=... (`agentloop "
                    "serve --control-key-env VAR`) and send 'Authorization: Bearer <control key>'", "control_disabled",
                    [])
        if _bearer_ok(header, self._control):
            return None
        return (401, f"{path} is a control route: send 'Authorization: Bearer <control key>' (the control_key the "
                "server was started with; the chat api_key does not open it)", "control_key_required", challenge)

    async def _read_body(self, scope: dict[str, Any], headers: Mapping[bytes, bytes], receive: Any,
                         send: Any, shape: ErrorBody) -> bytes | None:
        """The whole body, or None after answering 413/408 (or when the client went away)."""
        path = scope.get("path", "")
        limit, setting, timeout_s = self.per_path.get(path, (self.max_bytes, "max_request_bytes",
                                                             self.limits.body_timeout_s))
        declared = headers.get(b"content-length", b"")
        if declared.isdigit() and int(declared) > limit:
            await refuse(receive, send, 413, f"request body is {int(declared)} bytes; the limit is {limit} "
                         f"({setting})", "request_too_large", shape=shape)
            return None
        chunks: list[bytes] = []
        received = 0
        try:
            async with asyncio.timeout(timeout_s):
                while True:
                    message = await receive()
                    if message["type"] != "http.request":  # client went away
                        return None
                    chunk = message.get("body", b"")
                    received += len(chunk)
                    if received > limit:
                        break
                    chunks.append(chunk)
                    if not message.get("more_body", False):
                        return b"".join(chunks)
        except TimeoutError:
            setting = "weights_body_timeout_s" if path in self.per_path else "body_timeout_s"
            await refuse(receive, send, 408, f"the request body did not arrive within {timeout_s:g}s ({received} "
                         f"bytes received; ServerLimits.{setting}); send the body at once, or raise the limit on "
                         "the server", "request_timeout", shape=shape)
            return None
        del chunks
        await refuse(receive, send, 413, f"request body exceeds {limit} bytes ({setting})", "request_too_large",
                     shape=shape)
        return None


def _bearer_ok(header: bytes, expected: bytes) -> bool:
    scheme, _, token = header.strip().partition(b" ")
    # compare_digest: a plain == leaks the key's prefix length through timing.
    return scheme.lower() == b"bearer" and hmac.compare_digest(b"Bearer " + token.strip(), expected)


async def refuse(receive: Any, send: Any, status: int, message: str, code: str,
                 headers: list[tuple[bytes, bytes]] | None = None, *, shape: ErrorBody = openai_error) -> None:
    """Answer an ASGI request with an error (in ``shape``) without reading its body, then close
    the connection (middleware, outside FastAPI).

    The connection must close: what is left of the body must not be parsed as the next
    request, and a client stalling it must not keep the connection. But closing a socket with
    unread bytes makes the kernel send a reset, which can destroy the answer before a client
    that is still writing (httpx, most clients) reads it. So, as nginx's lingering close does,
    the whole answer is written first, then what the client still sends is dropped for at
    most ``LINGER_S``, then the connection closes.
    """
    body = json.dumps(shape(status, message, code)).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close"), *(headers or [])]})
    await send({"type": "http.response.body", "body": body, "more_body": True})
    try:
        async with asyncio.timeout(LINGER_S):
            while True:
                event = await receive()
                if event["type"] != "http.request" or not event.get("more_body", False):
                    break
    except TimeoutError:
        pass
    await send({"type": "http.response.body", "body": b""})


def error_response(status: int, message: str, code: str, shape: ErrorBody = openai_error) -> Any:
    """An error (OpenAI's shape unless ``shape`` says otherwise) as a FastAPI ``JSONResponse``."""
    from fastapi.responses import JSONResponse

    return JSONResponse(status_code=status, content=shape(status, message, code))


def install_error_handlers(app: Any, extra: Mapping[type[BaseException], tuple[int, str]] | None = None,
                           error_shapes: ErrorShapes | None = None) -> None:
    """Answer errors: ValueError and invalid bodies 400, CapabilityNotSupportedError 501, HTTP
    errors with their status (401 ``unauthorized``), anything else 500 with its message.

    Args:
        app: The FastAPI app.
        extra: More exception types and the ``(status, code)`` they map to.
        error_shapes: The error body of each request path; None: OpenAI's everywhere.
    """
    shapes = error_shapes or openai_everywhere

    def answer(request: Any, status: int, message: str, code: str) -> Any:
        return error_response(status, message, code, shapes(request.url.path))

    from fastapi.exceptions import RequestValidationError
    from starlette.exceptions import HTTPException as StarletteHTTPException

    for exc_type, (status, code) in (extra or {}).items():
        async def handler(request: Any, exc: BaseException, status: int = status, code: str = code) -> Any:
            return answer(request, status, f"{type(exc).__name__}: {exc}" if status >= 500 else str(exc), code)

        app.add_exception_handler(exc_type, handler)

    @app.exception_handler(ValueError)
    async def on_value_error(request: Any, exc: ValueError) -> Any:
        return answer(request, 400, str(exc), "invalid_request")

    @app.exception_handler(RequestValidationError)
    async def on_bad_body(request: Any, exc: RequestValidationError) -> Any:
        parts = [f"{'.'.join(str(p) for p in e.get('loc', ()))}: {e.get('msg')}" for e in exc.errors()]
        return answer(request, 400, "invalid request body: " + "; ".join(parts), "invalid_request")

    @app.exception_handler(CapabilityNotSupportedError)
    async def on_unsupported(request: Any, exc: CapabilityNotSupportedError) -> Any:
        return answer(request, 501, str(exc), "not_supported")

    # Starlette's base class: FastAPI raises it (not its own subclass) for unparseable bodies,
    # which would otherwise answer in FastAPI's {"detail": ...} shape instead of ours.
    @app.exception_handler(StarletteHTTPException)
    async def on_http(request: Any, exc: Any) -> Any:
        code = {401: "unauthorized", 404: "not_found"}.get(exc.status_code, "http_error")
        resp = answer(request, exc.status_code, str(exc.detail), code)
        for k, v in (exc.headers or {}).items():
            resp.headers[k] = v
        return resp

    # Registered for Exception, Starlette answers through this and still re-raises, so the
    # traceback is logged while the client gets the message (not a bare "Internal Server Error").
    @app.exception_handler(Exception)
    async def on_engine_error(request: Any, exc: Exception) -> Any:
        return answer(request, 500, f"{type(exc).__name__}: {exc}", "engine_error")


class UvicornThread:
    """Run an ASGI app with uvicorn in a background thread; a context manager.

    ``port=0`` picks a free port; read the address from :attr:`url` after entering.

    Args:
        app: The ASGI app.
        host: Bind address.
        port: TCP port, 0 for any free one.
        start_timeout_s: How long to wait for the socket to listen.
        log_level: uvicorn's log level.
        limits: Connection settings (see :class:`ServerLimits`); None: the defaults.
    """

    def __init__(self, app: Any, host: str = "127.0.0.1", port: int = 0, *, start_timeout_s: float = 30.0,
                 log_level: str = "warning", limits: ServerLimits | None = None) -> None:
        _, uvicorn = require_server_extra()
        config = uvicorn_config(app, host, port, limits or ServerLimits(), log_level)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, name="agentloop-http", daemon=True)
        self._start_timeout_s = start_timeout_s
        self.host = host
        self.port = port

    @property
    def url(self) -> str:
        """Base URL, e.g. ``http://127.0.0.1:40123``."""
        return f"http://{self.host}:{self.port}"

    def __enter__(self) -> Any:
        self._thread.start()
        deadline = time.monotonic() + self._start_timeout_s
        while not self._server.started:
            if not self._thread.is_alive():
                raise RuntimeError(f"HTTP server on {self.host}:{self.port} exited during start-up "
                                   "(port in use?); see the uvicorn log above")
            if time.monotonic() > deadline:
                self._server.should_exit = True
                raise TimeoutError(f"HTTP server did not start within {self._start_timeout_s}s")
            time.sleep(0.02)
        self.port = self._server.servers[0].sockets[0].getsockname()[1]
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)
