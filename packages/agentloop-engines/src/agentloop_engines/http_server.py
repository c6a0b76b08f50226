"""Serve an engine over HTTP: OpenAI-style chat plus the token-level ``/generate`` endpoint.

Endpoints (JSON):

* ``POST /generate`` ``{request_id, prompt_ids, sampling_params}`` ->
  ``{token_ids, log_probs, stop_reason}``: the token-in, token-out call agent loops train on;
* ``POST /abort`` ``{request_id}``;
* ``POST /update_weights``: the named tensors as one safetensors archive
  (``safetensors.torch.save`` bytes, ``application/octet-stream``), loaded with
  ``server.update_weights``; ``POST /sleep`` and ``POST /wake_up`` (no body);
* ``POST /v1/chat/completions``: delegates to ``server.chat_completion`` (black-box agents);
* ``GET /health``: liveness, capabilities, ``max_model_len`` and ``vocab_size`` (never needs
  the API key, so probes work).

Errors use OpenAI's shape ``{"error": {"message", "type", "code"}}``: bad input is 400 with
the engine's message, a missing or wrong bearer token 401, an oversized body 413, an
unsupported capability 501, any other engine error 500 with its message. The default bind address is 127.0.0.1: exposing an engine beyond
the host is an explicit choice, and should come with an ``api_key``.

Needs the ``[server]`` extra (fastapi, uvicorn); ``/update_weights`` also needs torch and
safetensors, which every engine that can load weights already has.
"""

# No `from __future__ import annotations`: FastAPI must resolve the request models defined
# inside create_app from real annotations, not strings naming a local scope.

import asyncio
import hmac
import logging
import threading
import time
from typing import Any

from agentloop_core.protocol import CapabilityNotSupported

logger = logging.getLogger(__name__)

__all__ = ["ServerThread", "create_app", "serve"]

DEFAULT_MAX_REQUEST_BYTES = 8 * 2**20
"""8 MiB: a 128k-token prompt as JSON ids is ~1 MiB, so this leaves room without inviting abuse."""

DEFAULT_MAX_WEIGHTS_BYTES = 16 * 2**30
"""16 GiB: one push of an 8B-parameter model in bf16 (~15 GiB). The body is held in memory and
deserialised next to it, so the server host needs about twice this in free RAM; models much
larger than this should sync weights over a collective (NCCL), not HTTP."""

_WEIGHTS_PATH = "/update_weights"

_LOOPBACK = {"127.0.0.1", "localhost", "::1"}


def _require_server_extra() -> tuple[Any, Any]:
    try:
        import fastapi
        import uvicorn
    except ImportError as exc:
        raise ImportError(
            f'the HTTP server needs {exc.name}: pip install "agentloop-engines[server]"'
        ) from exc
    return fastapi, uvicorn


class _LimitBodySize:
    """ASGI middleware: 413 for bodies over the limit, by header or by counting a streamed (chunked) body.

    ``/update_weights`` has its own, much larger limit: a model's weights are gigabytes, and
    raising the limit of every path to that would let any request pin that much memory.
    """

    def __init__(self, app: Any, max_bytes: int, max_weights_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.max_weights_bytes = max_weights_bytes

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if scope.get("path") == _WEIGHTS_PATH:
            limit, setting = self.max_weights_bytes, "max_weights_bytes"
        else:
            limit, setting = self.max_bytes, "max_request_bytes"
        for key, value in scope.get("headers", []):
            if key == b"content-length" and value.isdigit() and int(value) > limit:
                await _send_error(send, 413, f"request body is {int(value)} bytes; the limit is "
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
                await _send_error(send, 413, f"request body exceeds {limit} bytes ({setting})",
                                  "request_too_large")
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


async def _send_error(send: Any, status: int, message: str, code: str) -> None:
    import json

    body = json.dumps({"error": {"message": message, "type": "invalid_request_error", "code": code}}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


def create_app(server: Any, *, api_key: str | None = None,
               max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
               max_weights_bytes: int = DEFAULT_MAX_WEIGHTS_BYTES) -> Any:
    """Build the ASGI app serving ``server``.

    Args:
        server: An ``AsyncServer`` (an engine, or an ``LLMServerClient`` in front of several).
        api_key: When set, every endpoint but ``/health`` needs ``Authorization: Bearer <key>``.
        max_request_bytes: Larger request bodies get 413 (every path but ``/update_weights``).
        max_weights_bytes: Larger ``/update_weights`` bodies get 413.

    Returns:
        A FastAPI application (wrapped in the body-size limit).

    Raises:
        ImportError: without the ``[server]`` extra.
        ValueError: on a non-positive body limit or an empty ``api_key``.
    """
    fastapi, _ = _require_server_extra()
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse
    from pydantic import BaseModel, ConfigDict, Field
    from starlette.exceptions import HTTPException as StarletteHTTPException

    for name, limit in (("max_request_bytes", max_request_bytes), ("max_weights_bytes", max_weights_bytes)):
        if limit <= 0:
            raise ValueError(f"{name} must be positive, got {limit}")
    if api_key is not None and not api_key:
        raise ValueError("api_key is an empty string; pass None to disable auth or a real secret")

    class GenerateRequest(BaseModel):
        model_config = ConfigDict(extra="forbid")
        request_id: str = Field(min_length=1)
        prompt_ids: list[int]
        sampling_params: dict[str, Any] = Field(default_factory=dict)

    class AbortRequest(BaseModel):
        model_config = ConfigDict(extra="forbid")
        request_id: str = Field(min_length=1)

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

    app = fastapi.FastAPI(title="agentloop engine", docs_url=None, redoc_url=None, openapi_url=None)
    auth = [fastapi.Depends(check_auth)]

    def error(status: int, message: str, code: str) -> JSONResponse:
        return JSONResponse(status_code=status, content={
            "error": {"message": message, "type": "invalid_request_error" if status < 500 else "server_error",
                      "code": code}})

    @app.exception_handler(ValueError)
    async def on_value_error(request: Any, exc: ValueError) -> JSONResponse:
        return error(400, str(exc), "invalid_request")

    @app.exception_handler(RequestValidationError)
    async def on_bad_body(request: Any, exc: RequestValidationError) -> JSONResponse:
        parts = [f"{'.'.join(str(p) for p in e.get('loc', ()))}: {e.get('msg')}" for e in exc.errors()]
        return error(400, "invalid request body: " + "; ".join(parts), "invalid_request")

    @app.exception_handler(CapabilityNotSupported)
    async def on_unsupported(request: Any, exc: CapabilityNotSupported) -> JSONResponse:
        return error(501, str(exc), "not_supported")

    # Starlette's base class: FastAPI raises it (not its own subclass) for unparseable bodies,
    # which would otherwise answer in FastAPI's {"detail": ...} shape instead of ours.
    @app.exception_handler(StarletteHTTPException)
    async def on_http(request: Any, exc: Any) -> JSONResponse:
        resp = error(exc.status_code, str(exc.detail), "unauthorized" if exc.status_code == 401 else "http_error")
        for k, v in (exc.headers or {}).items():
            resp.headers[k] = v
        return resp

    # Registered for Exception, Starlette answers through this and still re-raises, so the
    # traceback is logged while the client gets the message (not a bare "Internal Server Error").
    @app.exception_handler(Exception)
    async def on_engine_error(request: Any, exc: Exception) -> JSONResponse:
        return error(500, f"{type(exc).__name__}: {exc}", "engine_error")

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "engine": type(server).__name__,
                "capabilities": server.capabilities.as_dict(),
                "max_model_len": getattr(server, "max_model_len", None),
                "vocab_size": getattr(server, "vocab_size", None)}

    @app.post("/generate", dependencies=auth)
    async def generate(req: GenerateRequest) -> dict[str, Any]:
        out = await server.generate(req.request_id, req.prompt_ids, req.sampling_params)
        return {"token_ids": list(out.token_ids),
                "log_probs": None if out.log_probs is None else list(out.log_probs),
                "stop_reason": out.stop_reason}

    @app.post("/abort", dependencies=auth)
    async def abort(req: AbortRequest) -> dict[str, Any]:
        await server.abort(req.request_id)
        return {"aborted": req.request_id}

    @app.post(_WEIGHTS_PATH, dependencies=auth)
    async def update_weights(request: fastapi.Request) -> dict[str, Any]:
        if not getattr(server.capabilities, "weight_update", False):
            raise CapabilityNotSupported(
                f"{type(server).__name__} does not load new weights (capabilities.weight_update=False)")
        tensors = await asyncio.to_thread(_load_safetensors, await request.body())
        try:
            await server.update_weights(list(tensors.items()))
        except KeyError as exc:  # an unknown weight name is the caller's mistake, like bad input
            raise ValueError(exc.args[0] if exc.args else str(exc)) from exc
        return {"updated": len(tensors)}

    @app.post("/sleep", dependencies=auth)
    async def sleep() -> dict[str, Any]:
        await _call_optional(server, "sleep")
        return {"status": "asleep"}

    @app.post("/wake_up", dependencies=auth)
    async def wake_up() -> dict[str, Any]:
        await _call_optional(server, "wake_up")
        return {"status": "awake"}

    @app.post("/v1/chat/completions", dependencies=auth)
    async def chat_completions(body: dict[str, Any]) -> dict[str, Any]:
        if not getattr(server.capabilities, "chat_completion", False) or not hasattr(server, "chat_completion"):
            raise CapabilityNotSupported(
                f"{type(server).__name__} does not serve chat completions (capabilities.chat_completion"
                "=False); use POST /generate with token ids"
            )
        return await server.chat_completion(body)

    return _LimitBodySize(app, max_request_bytes, max_weights_bytes)


def _load_safetensors(body: bytes) -> dict[str, Any]:
    try:
        from safetensors.torch import load
    except ImportError as exc:
        raise ImportError(f'POST /update_weights needs {exc.name}: pip install "agentloop-engines[hf]"') from exc
    if not body:
        raise ValueError("POST /update_weights has an empty body; send safetensors.torch.save(named_tensors)")
    try:
        return load(body)
    except Exception as exc:  # safetensors raises its own error type for a malformed archive
        raise ValueError(f"POST /update_weights body is not a safetensors archive: {exc}") from exc


async def _call_optional(server: Any, method: str) -> None:
    # An AsyncServer without the method (a minimal protocol implementation) cannot do it:
    # that is a 501, not an AttributeError turned into a 500.
    if not callable(getattr(server, method, None)):
        raise CapabilityNotSupported(f"{type(server).__name__} has no {method}()")
    await getattr(server, method)()


def _config(server: Any, host: str, port: int, api_key: str | None, max_request_bytes: int,
            max_weights_bytes: int, log_level: str) -> Any:
    _, uvicorn = _require_server_extra()
    if host not in _LOOPBACK and api_key is None:
        logger.warning("serving on %s without an api_key: anyone who can reach it can generate", host)
    app = create_app(server, api_key=api_key, max_request_bytes=max_request_bytes,
                     max_weights_bytes=max_weights_bytes)
    return uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=False)


def serve(server: Any, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None, *,
          max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES, max_weights_bytes: int = DEFAULT_MAX_WEIGHTS_BYTES,
          log_level: str = "info") -> None:
    """Serve ``server`` with uvicorn until interrupted (blocks).

    Args:
        server: The ``AsyncServer`` to expose.
        host: Bind address; loopback by default.
        port: TCP port.
        api_key: Bearer token required by every endpoint but ``/health``.
        max_request_bytes: Larger request bodies get 413 (every path but ``/update_weights``).
        max_weights_bytes: Larger ``/update_weights`` bodies get 413.
        log_level: uvicorn's log level.
    """
    _, uvicorn = _require_server_extra()
    config = _config(server, host, port, api_key, max_request_bytes, max_weights_bytes, log_level)
    uvicorn.Server(config).run()


class ServerThread:
    """Run the HTTP server in a background thread (tests, notebooks); a context manager.

    ``port=0`` picks a free port; read the address from :attr:`url` after entering.

    Args:
        server: The ``AsyncServer`` to expose. Its coroutines run on the thread's event loop.
        host: Bind address.
        port: TCP port, 0 for any free one.
        api_key: See :func:`create_app`.
        max_request_bytes: See :func:`create_app`.
        max_weights_bytes: See :func:`create_app`.
        start_timeout_s: How long to wait for the socket to listen.
    """

    def __init__(self, server: Any, host: str = "127.0.0.1", port: int = 0, api_key: str | None = None, *,
                 max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
                 max_weights_bytes: int = DEFAULT_MAX_WEIGHTS_BYTES, start_timeout_s: float = 30.0) -> None:
        _, uvicorn = _require_server_extra()
        config = _config(server, host, port, api_key, max_request_bytes, max_weights_bytes, "warning")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, name="agentloop-http", daemon=True)
        self._start_timeout_s = start_timeout_s
        self.host = host
        self.port = port

    @property
    def url(self) -> str:
        """Base URL, e.g. ``http://127.0.0.1:40123``."""
        return f"http://{self.host}:{self.port}"

    def __enter__(self) -> "ServerThread":
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
