"""Serve a server over HTTP: the token-level ``/generate`` endpoint plus the OpenAI-compatible ``/v1``.

Endpoints (JSON):

* ``POST /generate`` ``{request_id, prompt_ids, sampling_params}`` ->
  ``{token_ids, log_probs, stop_reason, instance}``: the token-in, token-out call agent loops
  train on; a prompt with images adds ``images`` (PNG, digest and token count of each, see
  :mod:`agentloop_engines.wire.images`), rebuilt by the model's vision processor within the
  server's image limits; with ``"stream": true`` the answer is newline-delimited JSON, one record per
  decoded delta and a last one carrying that same answer (see :mod:`agentloop_engines.wire.stream`);
* ``POST /forget_session`` ``{request_ids}`` -> ``{forgotten}``: those trajectories are over, so
  the engine drops what it keeps for them (``capabilities.forget_session``: HFServer's prefix-cache
  entry; 501 from an engine that keeps nothing), a chat route like ``/generate``;
* control routes, which need the ``control_key`` (``Authorization: Bearer <control key>``; the
  chat ``api_key`` never opens them; without a control key they answer 403, see
  :mod:`agentloop_engines.serving.control`): ``POST /abort`` ``{request_id}``; ``POST /update_weights``:
  the named tensors as one safetensors archive (``safetensors.torch.save`` bytes,
  ``application/octet-stream``), checked whole and loaded with ``server.update_weights``, one
  upload at a time (another one meanwhile gets 409 before its body is read); ``POST /sleep`` and
  ``POST /wake_up`` (no body); and the gateway's session routes (``GET /sessions``,
  ``POST``/``GET``/``DELETE /sessions/<id>``);
* ``POST /v1/chat/completions``, ``POST /v1/completions``, ``GET /v1/models``: the
  OpenAI-compatible gateway's (:mod:`agentloop_engines.serving.gateway`, the one implementation of
  ``/v1``), for black-box agents. With ``gateway=``, that gateway's, with its sessions
  (``/sessions/<id>/v1/...``); without, one built over ``server`` and its ``tokenizer`` that
  records no sessions (501 when the server has no tokenizer);
* ``GET /health``: liveness, capabilities, ``max_model_len``, ``vocab_size``, ``images``
  (whether ``/generate`` takes them, and the limits, or why not; ``capabilities.vision`` is
  true only when it does) and ``optional_routes`` (the routes above that older servers lack:
  ``/forget_session``), never needing the API key, so probes work.

Errors use OpenAI's shape ``{"error": {"message", "type", "code"}}``: bad input is 400 with
the engine's message, a missing or wrong bearer token 401 (answered from the headers, before
the body is read), a control route on a server without a control key 403, a second weight
upload while one runs 409, a body not received within ``body_timeout_s`` 408, an oversized body or
prompt 413, an unsupported capability 501, any other engine error 500 with its message, and
503 with ``Retry-After`` over ``max_in_flight`` (see
:class:`~agentloop_engines.serving.common.ServerLimits`). The default bind address is 127.0.0.1:
exposing an engine beyond the host is an explicit choice, and should come with an ``api_key``.

The ``/v1`` routes take no template text from clients and only the template variables of
``prompt_limits.template_variables`` (see :mod:`~agentloop_engines.serving.gateway.prompt_limits`).

Needs the ``[server]`` extra (fastapi, uvicorn); ``/update_weights`` also needs torch and
safetensors, which every engine that can load weights already has.
"""

# No `from __future__ import annotations`: FastAPI must resolve the request models defined
# inside create_app from real annotations, not strings naming a local scope.

import asyncio
import logging
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Annotated, Any

from agentloop_core.protocol import CapabilityNotSupportedError
from agentloop_core.vision import ImageLimits
from agentloop_engines.serving.common import (
    DEFAULT_MAX_REQUEST_BYTES,
    RequestGuard,
    ServerLimits,
    UvicornThread,
    install_error_handlers,
    require_server_extra,
    uvicorn_config,
    warn_if_exposed,
)
from agentloop_engines.serving.control import is_chat_path, new_control_key
from agentloop_engines.serving.gateway.app import add_gateway_routes, gateway_error_shapes
from agentloop_engines.serving.gateway.core import Gateway
from agentloop_engines.serving.gateway.images import resolve_vision
from agentloop_engines.serving.gateway.prompt_limits import PromptLimitError, PromptLimits
from agentloop_engines.wire.images import GenerateImages
from agentloop_engines.wire.routes import FORGET_BATCH, FORGET_SESSION_PATH, OPTIONAL_ROUTES
from agentloop_engines.wire.stream import INSTANCE_HEADER, NDJSON, ndjson_deltas
from agentloop_engines.wire.weights import load_safetensors

logger = logging.getLogger(__name__)

__all__ = ["ServerThread", "create_app", "serve"]

DEFAULT_MAX_WEIGHTS_BYTES = 16 * 2**30
"""16 GiB: one push of an 8B-parameter model in bf16 (~15 GiB). The body is held in memory and
deserialised next to it, so the server host needs about twice this in free RAM; models much
larger than this should sync weights over a collective (NCCL), not HTTP."""

_WEIGHTS_PATH = "/update_weights"


def create_app(server: Any, *, api_key: str | None = None,
               max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
               max_weights_bytes: int = DEFAULT_MAX_WEIGHTS_BYTES, gateway: Gateway | None = None,
               limits: ServerLimits | None = None, prompt_limits: PromptLimits | None = None,
               tool_parser: str | None = None, control_key: str | None = None,
               image_limits: ImageLimits | None = None) -> Any:
    """Build the ASGI app serving ``server``.

    Args:
        server: An ``AsyncServer`` (an engine, or an ``LLMServerClient`` in front of several).
        api_key: When set, every chat endpoint needs ``Authorization: Bearer <key>``.
        max_request_bytes: Larger request bodies get 413 (every path but ``/update_weights``).
        max_weights_bytes: Larger ``/update_weights`` bodies get 413.
        control_key: The bearer token of the control routes (``/update_weights``, ``/sleep``,
            ``/wake_up``, ``/abort``, the session admin routes); None: they answer 403.
        gateway: A :class:`~agentloop_engines.serving.gateway.Gateway` (usually over the same
            ``server``) whose OpenAI-compatible endpoints and per-session recording
            (``/v1/chat/completions``, ``/v1/completions``, ``/v1/models``, ``/sessions/...``)
            this app serves, so one port serves both ``/generate`` and black-box agents. None:
            the same ``/v1`` endpoints from a gateway over ``server`` and ``server.tokenizer``,
            without sessions (images with the vision processor of the tokenizer's checkpoint
            folder and the default image limits); a server without a tokenizer answers them with 501.
        limits: In-flight limit and body deadlines (see
            :class:`~agentloop_engines.serving.common.ServerLimits`); None: the defaults.
        prompt_limits: What a ``/v1`` request may make the gateway built without ``gateway=``
            render (template variables, messages, characters, tokens); None: the defaults.
            With ``gateway=``, the gateway's own ``prompt_limits`` apply instead.
        tool_parser: The tool-call parser of the gateway built without ``gateway=`` (a core
            parser name such as ``hermes``); None: requests with ``tools`` are 400.
        image_limits: The pixel, byte and count limits of the images a ``/generate`` request
            sends; None: the ``/v1`` gateway's (``Gateway(max_images=...)`` and its siblings).

    Returns:
        A FastAPI application wrapped in the :class:`~agentloop_engines.serving.common.RequestGuard`.

    Raises:
        ImportError: without the ``[server]`` extra.
        ValueError: on a non-positive body limit, an empty ``api_key``, a ``control_key`` that is
            empty or equals ``api_key``, or ``tool_parser`` with ``gateway`` (the gateway's own
            parser applies).
    """
    fastapi, _ = require_server_extra()
    from fastapi import Request  # importable now; a class, so it can annotate the handler
    from fastapi.responses import StreamingResponse
    from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr

    if max_weights_bytes <= 0:
        raise ValueError(f"max_weights_bytes must be positive, got {max_weights_bytes}")
    if gateway is not None and tool_parser is not None:
        raise ValueError("tool_parser= configures the gateway create_app builds when none is given; with gateway=, "
                         "set it on the gateway instead: Gateway(server, tokenizer, tool_parser=...)")
    limits = limits or ServerLimits()

    class WireImage(BaseModel):  # see agentloop_engines.wire.images
        model_config = ConfigDict(extra="forbid")
        data: StrictStr
        digest: StrictStr
        num_tokens: StrictInt | None = None

    class GenerateRequest(BaseModel):
        model_config = ConfigDict(extra="forbid")
        request_id: str = Field(min_length=1)
        prompt_ids: list[StrictInt]  # "5", true and 5.0 are not token ids (lax int would take them)
        sampling_params: dict[str, Any] = Field(default_factory=dict)
        stream: StrictBool = False
        images: list[WireImage] = Field(default_factory=list)

    class AbortRequest(BaseModel):
        model_config = ConfigDict(extra="forbid")
        request_id: str = Field(min_length=1)

    class ForgetRequest(BaseModel):
        model_config = ConfigDict(extra="forbid")
        request_ids: list[Annotated[StrictStr, Field(min_length=1)]] = Field(min_length=1, max_length=FORGET_BATCH)

    app = fastapi.FastAPI(title="agentloop engine", docs_url=None, redoc_url=None, openapi_url=None)
    # Uploads are parsed here, not on the default executor that other code on the loop may fill.
    weights_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="agentloop-weights-in")
    # Names this server's lifetime in /generate and /update_weights answers: a client that sees
    # it change knows the engine restarted (from its checkpoint) and lost the weights it pushed.
    instance = uuid.uuid4().hex
    install_error_handlers(app, {PromptLimitError: (413, "request_too_large")}, error_shapes=gateway_error_shapes)
    v1_gateway = gateway if gateway is not None else _sessionless_gateway(server, prompt_limits, tool_parser)
    images = _generate_images(server, v1_gateway, image_limits)

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "engine": type(server).__name__,
                # vision: what a client may send to /generate, not only what the engine could take.
                "capabilities": {**server.capabilities.as_dict(), "vision": images.refusal is None},
                "images": images.declared(),
                # Routes an older server lacks, so a client calls them only where they exist.
                "optional_routes": list(OPTIONAL_ROUTES),
                "max_model_len": getattr(server, "max_model_len", None),
                "vocab_size": getattr(server, "vocab_size", None)}

    @app.post("/generate")
    async def generate(req: GenerateRequest) -> Any:
        multi_modal = await images.multi_modal(req.images)
        if req.stream:
            # The first delta is awaited before the 200: a refused request gets its own status.
            lines = await ndjson_deltas(server, req.request_id, req.prompt_ids, req.sampling_params, instance,
                                        multi_modal=multi_modal)
            return StreamingResponse(lines, media_type=NDJSON, headers={"Cache-Control": "no-cache", INSTANCE_HEADER: instance})
        out = await server.generate(req.request_id, req.prompt_ids, req.sampling_params, **multi_modal)
        return {"token_ids": list(out.token_ids),
                "log_probs": None if out.log_probs is None else list(out.log_probs),
                "stop_reason": out.stop_reason, "instance": instance}

    @app.post("/abort")
    async def abort(req: AbortRequest) -> dict[str, Any]:
        await server.abort(req.request_id)
        return {"aborted": req.request_id}

    @app.post(FORGET_SESSION_PATH)
    async def forget_session(req: ForgetRequest) -> dict[str, Any]:
        if not getattr(server.capabilities, "forget_session", False):
            raise CapabilityNotSupportedError(f"{type(server).__name__} keeps nothing per trajectory "
                                              "(capabilities.forget_session=False): there is nothing to forget")
        for request_id in req.request_ids:
            server.forget_session(request_id)  # a plain, cheap method (HFServer: a dict entry, under a lock)
        return {"forgotten": len(req.request_ids)}

    @app.post(_WEIGHTS_PATH)
    async def update_weights(request: Request) -> dict[str, Any]:
        if not getattr(server.capabilities, "weight_update", False):
            raise CapabilityNotSupportedError(
                f"{type(server).__name__} does not load new weights (capabilities.weight_update=False)")
        body = await request.body()
        tensors = await asyncio.get_running_loop().run_in_executor(weights_pool, load_safetensors, body)
        try:
            await server.update_weights(list(tensors.items()))
        except KeyError as exc:  # an unknown weight name is the caller's mistake, like bad input
            raise ValueError(exc.args[0] if exc.args else str(exc)) from exc
        return {"updated": len(tensors), "instance": instance}

    @app.post("/sleep")
    async def sleep() -> dict[str, Any]:
        await _call_optional(server, "sleep")
        return {"status": "asleep"}

    @app.post("/wake_up")
    async def wake_up() -> dict[str, Any]:
        await _call_optional(server, "wake_up")
        return {"status": "awake"}

    if gateway is not None:
        add_gateway_routes(app, gateway)
    elif v1_gateway is not None:
        add_gateway_routes(app, v1_gateway, sessions=False)
    else:
        _add_no_tokenizer_routes(app, server)

    # The guard refuses an empty api_key and a non-positive max_request_bytes.
    return RequestGuard(app, api_key=api_key, max_bytes=max_request_bytes, limits=limits,
                        per_path={_WEIGHTS_PATH: (max_weights_bytes, "max_weights_bytes", limits.weights_body_timeout_s)},
                        control_key=control_key, is_chat=is_chat_path, error_shapes=gateway_error_shapes,
                        one_at_a_time=(_WEIGHTS_PATH,))


def _sessionless_gateway(server: Any, prompt_limits: PromptLimits | None, tool_parser: str | None) -> Gateway | None:
    """The gateway over ``server`` serving ``/v1`` when ``create_app`` is given none; None when
    the server has no tokenizer to render chat messages with."""
    tokenizer = getattr(server, "tokenizer", None)
    if tokenizer is None:
        if tool_parser is not None:
            raise ValueError(f"tool_parser={tool_parser!r} needs the /v1 routes, but {type(server).__name__} has no "
                             "tokenizer; construct it with tokenizer=..., or pass gateway=Gateway(server, tokenizer, "
                             "tool_parser=...)")
        return None
    return Gateway(server, tokenizer, tool_parser=tool_parser, prompt_limits=prompt_limits)


def _generate_images(server: Any, gateway: Gateway | None, limits: ImageLimits | None) -> GenerateImages:
    """How ``/generate`` rebuilds images: the vision processor and limits of the ``/v1`` gateway
    (one model, one processor), else a processor loaded from the checkpoint folder of ``server``."""
    vision = gateway.images.vision if gateway is not None else None
    why = ""
    # A text-only engine refuses images whatever the folder holds: nothing to load for it.
    if vision is None and getattr(getattr(server, "capabilities", None), "vision", False):
        tokenizer = gateway.tokenizer if gateway is not None else getattr(server, "tokenizer", None)
        vision, why = resolve_vision("auto", tokenizer, server)
    if limits is None:
        limits = gateway.images.limits if gateway is not None else ImageLimits(allow_paths=False)
    return GenerateImages(server, vision, why, limits)


def _add_no_tokenizer_routes(app: Any, server: Any) -> None:
    # Without a tokenizer nothing can render messages or decode a reply: 501 (the server cannot),
    # not 404 (the client asked for a path that does not exist).
    async def unavailable() -> None:
        raise CapabilityNotSupportedError(
            f"{type(server).__name__} has no tokenizer, so this server cannot answer OpenAI /v1 requests; construct "
            "it with tokenizer=..., or serve it with gateway=Gateway(server, tokenizer); or use POST /generate "
            "with token ids")

    for path, method in (("/v1/chat/completions", "POST"), ("/v1/completions", "POST"), ("/v1/models", "GET")):
        app.add_api_route(path, unavailable, methods=[method])


async def _call_optional(server: Any, method: str) -> None:
    # An AsyncServer without the method (a minimal protocol implementation) cannot do it:
    # that is a 501, not an AttributeError turned into a 500.
    if not callable(getattr(server, method, None)):
        raise CapabilityNotSupportedError(f"{type(server).__name__} has no {method}()")
    await getattr(server, method)()


def serve(server: Any, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None, *,
          max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES, max_weights_bytes: int = DEFAULT_MAX_WEIGHTS_BYTES,
          log_level: str = "info", gateway: Gateway | None = None, limits: ServerLimits | None = None,
          prompt_limits: PromptLimits | None = None, tool_parser: str | None = None,
          control_key: str | None = None, image_limits: ImageLimits | None = None) -> None:
    """Serve ``server`` with uvicorn until interrupted (blocks).

    Args:
        server: The ``AsyncServer`` to expose.
        host: Bind address; loopback by default.
        port: TCP port.
        api_key: Bearer token required by every chat endpoint (``/generate``, ``/v1``).
        max_request_bytes: Larger request bodies get 413 (every path but ``/update_weights``).
        max_weights_bytes: Larger ``/update_weights`` bodies get 413.
        log_level: uvicorn's log level.
        gateway: Serve this gateway's OpenAI endpoints and sessions too (see :func:`create_app`).
        limits: See :func:`create_app`; also uvicorn's connection settings.
        prompt_limits: See :func:`create_app`.
        tool_parser: See :func:`create_app`.
        control_key: See :func:`create_app` (None: no control routes; a trainer pushing weights
            to this server needs one).
        image_limits: See :func:`create_app`.
    """
    _, uvicorn = require_server_extra()
    warn_if_exposed(host, api_key)
    limits = limits or ServerLimits()
    app = create_app(server, api_key=api_key, max_request_bytes=max_request_bytes,
                     max_weights_bytes=max_weights_bytes, gateway=gateway, limits=limits, prompt_limits=prompt_limits,
                     tool_parser=tool_parser, control_key=control_key, image_limits=image_limits)
    uvicorn.Server(uvicorn_config(app, host, port, limits, log_level)).run()


class ServerThread(UvicornThread):
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
        gateway: See :func:`create_app`.
        limits: See :func:`create_app`; also uvicorn's connection settings.
        prompt_limits: See :func:`create_app`.
        tool_parser: See :func:`create_app`.
        control_key: See :func:`create_app`; None: a fresh random one (:attr:`control_key`), so
            only the code that started the thread can control the engine.
        image_limits: See :func:`create_app`.
    """

    def __init__(self, server: Any, host: str = "127.0.0.1", port: int = 0, api_key: str | None = None, *,
                 max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
                 max_weights_bytes: int = DEFAULT_MAX_WEIGHTS_BYTES, start_timeout_s: float = 30.0,
                 gateway: Gateway | None = None, limits: ServerLimits | None = None,
                 prompt_limits: PromptLimits | None = None, tool_parser: str | None = None,
                 control_key: str | None = None, image_limits: ImageLimits | None = None) -> None:
        warn_if_exposed(host, api_key)
        self.control_key = control_key if control_key is not None else new_control_key()
        """The control routes' bearer token: give it to the trainer's ``EngineHTTPClient(control_key=...)``,
        never to chat clients."""
        app = create_app(server, api_key=api_key, max_request_bytes=max_request_bytes,
                         max_weights_bytes=max_weights_bytes, gateway=gateway, limits=limits,
                         prompt_limits=prompt_limits, tool_parser=tool_parser, control_key=self.control_key,
                         image_limits=image_limits)
        super().__init__(app, host, port, start_timeout_s=start_timeout_s, limits=limits)

    def __enter__(self) -> "ServerThread":
        return super().__enter__()
