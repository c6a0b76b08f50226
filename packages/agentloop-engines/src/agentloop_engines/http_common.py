"""What every agentloop HTTP app shares: the ``[server]`` extra check, the body-size limit,
bearer auth, OpenAI-shaped errors, and running uvicorn in a background thread.

Used by the engine server (:mod:`agentloop_engines.http_server`) and the OpenAI-compatible
gateway (:mod:`agentloop_engines.gateway`), so both answer auth, size and input errors the
same way: ``{"error": {"message", "type", "code"}}``.
"""

# No `from __future__ import annotations`: FastAPI resolves the dependency's Header annotation.

import hmac
import json
import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from agentloop_core.protocol import CapabilityNotSupported

logger = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_MAX_REQUEST_BYTES",
    "LimitBodySize",
    "UvicornThread",
    "bearer_auth",
    "error_response",
    "install_error_handlers",
    "require_server_extra",
    "warn_if_exposed",
]

DEFAULT_MAX_REQUEST_BYTES = 8 * 2**20
"""8 MiB: a 128k-token prompt as JSON ids is ~1 MiB, so this leaves room without inviting abuse."""

LOOPBACK = {"127.0.0.1", "localhost", "::1"}


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


class LimitBodySize:
    """ASGI middleware: 413 for bodies over the limit, by header or by counting a streamed (chunked) body.

    Args:
        app: The wrapped ASGI app.
        max_bytes: The limit of every path not in ``per_path``.
        per_path: ``{path: (limit, setting name)}`` for paths with their own limit (the engine
            server's ``/update_weights``: a model's weights are gigabytes, and raising the
            limit of every path to that would let any request pin that much memory).
    """

    def __init__(self, app: Any, max_bytes: int, per_path: Mapping[str, tuple[int, str]] | None = None) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.per_path = dict(per_path or {})

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit, setting = self.per_path.get(scope.get("path", ""), (self.max_bytes, "max_request_bytes"))
        for key, value in scope.get("headers", []):
            if key == b"content-length" and value.isdigit() and int(value) > limit:
                await send_error(send, 413, f"request body is {int(value)} bytes; the limit is "
                                 f"{limit} ({setting})", "request_too_large")
                return
        # Buffer the body before the app sees it: FastAPI turns any error raised while it reads
        # the body into a generic 400, so the limit must be enforced out here.
        chunks: list[bytes] = []
        received = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # client went away
                return
            chunk = message.get("body", b"")
            received += len(chunk)
            if received > limit:
                await send_error(send, 413, f"request body exceeds {limit} bytes ({setting})", "request_too_large")
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        del chunks  # a weights body would otherwise be held twice for the whole request
        replayed = False

        async def replay() -> dict[str, Any]:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


async def send_error(send: Any, status: int, message: str, code: str) -> None:
    """Answer an ASGI request with an OpenAI-shaped error (for middleware, outside FastAPI)."""
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error", "code": code}}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


def error_response(status: int, message: str, code: str) -> Any:
    """An OpenAI-shaped error as a FastAPI ``JSONResponse``."""
    from fastapi.responses import JSONResponse

    return JSONResponse(status_code=status, content={
        "error": {"message": message, "type": "invalid_request_error" if status < 500 else "server_error",
                  "code": code}})


def bearer_auth(api_key: str | None) -> Callable[..., None]:
    """A FastAPI dependency that answers 401 unless ``Authorization: Bearer <api_key>`` (no-op
    when ``api_key`` is None).

    Raises:
        ValueError: on an empty ``api_key`` (pass None to disable auth).
    """
    fastapi, _ = require_server_extra()
    if api_key is not None and not api_key:
        raise ValueError("api_key is an empty string; pass None to disable auth or a real secret")
    expected = api_key.encode() if api_key is not None else None

    def check_auth(authorization: str | None = fastapi.Header(default=None)) -> None:
        if expected is None:
            return
        scheme, _, token = (authorization or "").partition(" ")
        # compare_digest: a plain == leaks the key's prefix length through timing.
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), expected):
            raise fastapi.HTTPException(
                status_code=401, detail="missing or invalid API key; send 'Authorization: Bearer <key>'",
                headers={"WWW-Authenticate": "Bearer"},
            )

    return check_auth


def install_error_handlers(app: Any, extra: Mapping[type[BaseException], tuple[int, str]] | None = None) -> None:
    """Answer errors in OpenAI's shape: ValueError and invalid bodies 400, CapabilityNotSupported
    501, HTTP errors with their status (401 ``unauthorized``), anything else 500 with its message.

    Args:
        app: The FastAPI app.
        extra: More exception types and the ``(status, code)`` they map to.
    """
    from fastapi.exceptions import RequestValidationError
    from starlette.exceptions import HTTPException as StarletteHTTPException

    for exc_type, (status, code) in (extra or {}).items():
        async def handler(request: Any, exc: BaseException, status: int = status, code: str = code) -> Any:
            return error_response(status, f"{type(exc).__name__}: {exc}" if status >= 500 else str(exc), code)

        app.add_exception_handler(exc_type, handler)

    @app.exception_handler(ValueError)
    async def on_value_error(request: Any, exc: ValueError) -> Any:
        return error_response(400, str(exc), "invalid_request")

    @app.exception_handler(RequestValidationError)
    async def on_bad_body(request: Any, exc: RequestValidationError) -> Any:
        parts = [f"{'.'.join(str(p) for p in e.get('loc', ()))}: {e.get('msg')}" for e in exc.errors()]
        return error_response(400, "invalid request body: " + "; ".join(parts), "invalid_request")

    @app.exception_handler(CapabilityNotSupported)
    async def on_unsupported(request: Any, exc: CapabilityNotSupported) -> Any:
        return error_response(501, str(exc), "not_supported")

    # Starlette's base class: FastAPI raises it (not its own subclass) for unparseable bodies,
    # which would otherwise answer in FastAPI's {"detail": ...} shape instead of ours.
    @app.exception_handler(StarletteHTTPException)
    async def on_http(request: Any, exc: Any) -> Any:
        code = {401: "unauthorized", 404: "not_found"}.get(exc.status_code, "http_error")
        resp = error_response(exc.status_code, str(exc.detail), code)
        for k, v in (exc.headers or {}).items():
            resp.headers[k] = v
        return resp

    # Registered for Exception, Starlette answers through this and still re-raises, so the
    # traceback is logged while the client gets the message (not a bare "Internal Server Error").
    @app.exception_handler(Exception)
    async def on_engine_error(request: Any, exc: Exception) -> Any:
        return error_response(500, f"{type(exc).__name__}: {exc}", "engine_error")


class UvicornThread:
    """Run an ASGI app with uvicorn in a background thread; a context manager.

    ``port=0`` picks a free port; read the address from :attr:`url` after entering.

    Args:
        app: The ASGI app.
        host: Bind address.
        port: TCP port, 0 for any free one.
        start_timeout_s: How long to wait for the socket to listen.
        log_level: uvicorn's log level.
    """

    def __init__(self, app: Any, host: str = "127.0.0.1", port: int = 0, *, start_timeout_s: float = 30.0,
                 log_level: str = "warning") -> None:
        _, uvicorn = require_server_extra()
        config = uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=False)
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
