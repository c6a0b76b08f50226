"""``EngineHTTPClient``: an ``AsyncServer`` client of a remote agentloop HTTP server (``/generate``).

Put it in :class:`~agentloop_engines.fleet.client.LLMServerClient` to balance over engine replicas
that run elsewhere (other hosts, or servers a trainer did not start)::

    client = LLMServerClient([EngineHTTPClient("http://gpu-0:8000", api_key=key, control_key=control),
                              EngineHTTPClient("http://gpu-1:8000", api_key=key, control_key=control)])

It speaks the endpoints of :mod:`agentloop_engines.serving.server`: ``generate`` with the
``api_key`` (and ``generate_stream``, its streamed form: :mod:`agentloop_engines.wire.stream`;
and ``forget_session``, sent without waiting where the server lists its route), and the control calls (``abort``, ``sleep``, ``wake_up``, ``update_weights``) with
the ``control_key`` (see :mod:`agentloop_engines.serving.control`). It raises what an in-process
engine would: 400 and 413 -> ``ValueError`` (the server's message), 401 and 403 -> ``PermissionError``,
501 -> ``CapabilityNotSupportedError``, 500 and unexpected statuses -> :class:`EngineHTTPError`.
A server that cannot be reached, a dropped connection, 502/503/504 ->
:class:`ReplicaUnavailableError`, a ``ConnectionError``, so ``LLMServerClient`` takes the replica
out of rotation and retries the request elsewhere; a read timeout (only with ``timeout_s``) ->
``TimeoutError``, which it treats as it treats its own ``request_timeout_s``. A 503 with
``Retry-After`` (the server's in-flight limit) -> :class:`ReplicaBusyError`: backpressure, which
``LLMServerClient`` answers by going elsewhere or waiting, never by taking the replica out.

Every answer is read within ``max_response_bytes`` (see :mod:`agentloop_engines.fleet.http_body`): a
server that sends more fails the call with :class:`ResponseTooLargeError`, a
:class:`EngineHTTPError`, instead of filling the client's memory. A prompt's images travel
with it (``multi_modal_data``, see :mod:`agentloop_engines.wire.images`) when the server
declares ``capabilities.vision``.

Needs the ``[server]`` extra (httpx); ``update_weights`` also needs torch and safetensors
(the ``[hf]`` extra).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
from collections.abc import AsyncGenerator, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import fields
from typing import Any

from agentloop_core.protocol import (
    CapabilityNotSupportedError,
    SamplingParams,
    ServerCapabilities,
    TokenOutput,
)
from agentloop_core.vision.content import images_of
from agentloop_engines.fleet.http_body import DEFAULT_MAX_RESPONSE_BYTES, BoundedBody, bounded_lines
from agentloop_engines.fleet.http_errors import (
    EngineHTTPError,
    ReplicaBusyError,
    ReplicaUnavailableError,
    ResponseTooLargeError,
    error_code,
)
from agentloop_engines.fleet.http_errors import retry_after_s as _retry_after_s
from agentloop_engines.fleet.id_batches import IdBatches
from agentloop_engines.streaming import TokenDelta
from agentloop_engines.wire.images import encode_images
from agentloop_engines.wire.routes import FORGET_BATCH, FORGET_SESSION_PATH, has_route
from agentloop_engines.wire.stream import INSTANCE_HEADER, read_ndjson_deltas
from agentloop_engines.wire.weights import serialize_weights

__all__ = ["DEFAULT_MAX_RESPONSE_BYTES", "EngineHTTPClient", "EngineHTTPError", "ReplicaBusyError",
           "ReplicaUnavailableError", "ResponseTooLargeError", "serialize_weights"]


def _require_httpx() -> Any:
    try:
        import httpx
    except ImportError as exc:
        raise ImportError('EngineHTTPClient needs httpx: pip install "agentloop-engines[server]"') from exc
    return httpx


def _token_id(t: Any) -> Any:
    # numpy/torch integers are valid ids but not JSON; anything else goes as is and the
    # server answers 400 naming the bad position, as an in-process engine would.
    return int(t) if hasattr(t, "__index__") and not isinstance(t, bool) else t


class EngineHTTPClient:
    """An ``AsyncServer`` over HTTP: every call is a request to a remote server.

    Capabilities, ``max_model_len`` and ``vocab_size`` come from the server's ``GET /health``,
    fetched once: by ``await connect()``, or on first access of those attributes (a blocking
    request; inside a running event loop, ``await connect()`` first). Connections are opened
    lazily on the running event loop, so a ``EngineHTTPClient`` may be created outside one and used
    on one loop after another (one at a time); ``await close()`` before a loop ends, as
    connections left on a finished loop can only be abandoned.

    Args:
        base_url: The server's address, e.g. ``http://10.0.0.5:8000``.
        api_key: Bearer token, when the server was started with ``api_key``.
        control_key: The server's control key, for ``abort``, ``sleep``, ``wake_up`` and
            ``update_weights`` (the trainer's; never a chat client's). None: those calls fail
            with ``PermissionError``.
        timeout_s: Limit on reading a response (and sending a body). None: no limit.
        connect_timeout_s: Limit on opening a connection; also the whole limit for ``/health``.
        max_connections: Most concurrent connections; requests beyond it wait for a free one.
        max_response_bytes: Most bytes of one answer (a streamed one in total) read from the
            server; past it the call fails with :class:`ResponseTooLargeError` and the
            connection is dropped (see :data:`~agentloop_engines.fleet.http_body.DEFAULT_MAX_RESPONSE_BYTES`).

    Raises:
        ValueError: on a ``base_url`` that is not http(s), an empty ``api_key`` or
            ``control_key``, or a non-positive limit.
    """

    def __init__(self, base_url: str, *, api_key: str | None = None, timeout_s: float | None = None,
                 connect_timeout_s: float = 10.0, max_connections: int = 256,
                 control_key: str | None = None, max_response_bytes: int = DEFAULT_MAX_RESPONSE_BYTES) -> None:
        self._httpx = _require_httpx()
        if not base_url.startswith(("http://", "https://")):
            raise ValueError(f"base_url must start with http:// or https://, got {base_url!r}")
        if api_key is not None and not api_key:
            raise ValueError("api_key is an empty string; pass None for a server without auth")
        if control_key is not None and not control_key:
            raise ValueError("control_key is an empty string; pass the server's control key, or None")
        if timeout_s is not None and timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0 or None, got {timeout_s}")
        if connect_timeout_s <= 0 or max_connections < 1:
            raise ValueError(f"connect_timeout_s must be > 0 and max_connections >= 1, got "
                             f"{connect_timeout_s} and {max_connections}")
        if isinstance(max_response_bytes, bool) or not isinstance(max_response_bytes, int) or max_response_bytes < 1:
            raise ValueError(f"max_response_bytes must be a positive integer, got {max_response_bytes!r}")
        self.max_response_bytes = max_response_bytes
        self.base_url = base_url.rstrip("/")
        self.api_key = api_key
        self.timeout_s = timeout_s
        self.connect_timeout_s = connect_timeout_s
        # No read timeout by default: an agentic generation can rightly take minutes, and
        # LLMServerClient's request_timeout_s (or the rollout's timeout) is the backstop for a
        # hung replica. The pool wait is unlimited too: max_connections is a concurrency cap.
        self._timeout = self._httpx.Timeout(timeout_s, connect=connect_timeout_s)
        self._limits = self._httpx.Limits(max_connections=max_connections,
                                          max_keepalive_connections=max_connections)
        # identity: answers are counted as they arrive, and compressed ones are refused (see http_body).
        self._headers = {"Accept-Encoding": "identity", **({"Authorization": f"Bearer {api_key}"} if api_key else {})}
        self._control_headers = {"Authorization": f"Bearer {control_key}"} if control_key else {}
        self._has_control_key = control_key is not None  # the key itself is kept in the headers only
        self._health: dict[str, Any] | None = None
        self.engine_instance: str | None = None
        """The server's lifetime id from its last ``/generate`` or ``/update_weights`` answer
        (None before one, or from a server that sends none); it changes when the engine restarts."""
        self._http: Any = None
        # Not the default executor, which other code on the loop (sync agents, reward
        # functions) may fill: a weight push must not wait behind them.
        self._serializer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="agentloop-weights-out")
        self._image_encoder = ThreadPoolExecutor(max_workers=1, thread_name_prefix="agentloop-images-out")
        self._loop: asyncio.AbstractEventLoop | None = None
        self._forgets = IdBatches(self._send_forgets, FORGET_BATCH, f"{self.base_url}: forget_session")

    def __repr__(self) -> str:
        return f"EngineHTTPClient({self.base_url!r})"

    # ---- what the server declares --------------------------------------------------------

    async def connect(self) -> ServerCapabilities:
        """Fetch ``/health`` (without blocking the event loop) and return the capabilities.

        Raises:
            ReplicaUnavailableError: when the server cannot be reached.
            ResponseTooLargeError: an answer over ``max_response_bytes`` (not an engine server).
        """
        self._health = self._parse_health(await self._request("GET", "/health", timeout=self.connect_timeout_s))
        return self._health["capabilities"]

    def _info(self) -> dict[str, Any]:
        if self._health is None:
            url = f"{self.base_url}/health"
            what = f"GET {url}"
            try:
                with self._httpx.stream("GET", url, timeout=self.connect_timeout_s,
                                        headers={"Accept-Encoding": "identity"}) as response:
                    bounded = self._bounded(response, what)
                    body = bounded.read_sync(response.iter_raw())
            except self._httpx.TransportError as exc:
                raise self._transport_error(exc, what) from exc
            self._health = self._parse_health(self._checked(response, body, what))
        return self._health

    def _parse_health(self, body: Any) -> dict[str, Any]:
        caps = body.get("capabilities") if isinstance(body, dict) else None
        if not isinstance(caps, dict):
            raise EngineHTTPError(f"{self.base_url}/health has no capabilities; is it an agentloop engine "
                                    "server (agentloop_engines.serving.server)?")
        # Flags a newer server adds are ignored; ones it lacks keep their defaults. vision only
        # where /generate takes images ("images" in /health): an older server declared the
        # engine's vision but refused images on /generate.
        known = {f.name for f in fields(ServerCapabilities)}
        flags = {k: bool(v) for k, v in caps.items() if k in known}
        images = body.get("images")
        accepted = isinstance(images, dict) and images.get("accepted") is True
        flags["vision"] = flags.get("vision", False) and accepted
        # forget_session only where the server has its route: an older one declared the
        # engine's flag with no route to call (its engine's own bound then ages entries out).
        flags["forget_session"] = flags.get("forget_session", False) and has_route(body, FORGET_SESSION_PATH)
        reason = images.get("reason") if isinstance(images, dict) else None
        return {"capabilities": ServerCapabilities(**flags), "max_model_len": body.get("max_model_len"),
                "vocab_size": body.get("vocab_size"),
                "no_images": reason if isinstance(reason, str) else "the server is of a version that takes no images "
                "over /generate; update agentloop-engines on the server"}

    @property
    def capabilities(self) -> ServerCapabilities:
        """What the remote server declares (from ``/health``)."""
        return self._info()["capabilities"]

    @property
    def max_model_len(self) -> int | None:
        """The remote server's context length, or None when it does not say."""
        return self._info()["max_model_len"]

    @property
    def vocab_size(self) -> int | None:
        """The remote server's vocabulary size, or None when it does not say."""
        return self._info()["vocab_size"]

    # ---- AsyncServer ---------------------------------------------------------------------

    async def generate(self, request_id: str, prompt_ids: list[int],
                       sampling_params: Mapping[str, Any] | SamplingParams | None = None, *,
                       multi_modal_data: Mapping[str, Any] | None = None) -> TokenOutput:
        """Generate on the remote server (see ``AsyncServer.generate``).

        Sampling parameters are validated by the server, which is the authority on them; so is
        its vision processor on images, which the server rebuilds from their pixels.

        Raises:
            ValueError: the server rejected the request (its message, e.g. an unknown key or an
                image over its limits), or malformed ``multi_modal_data``.
            CapabilityNotSupportedError: images for a server that does not declare ``vision``
                (nothing is sent).
            PermissionError: a missing or wrong ``api_key``.
            ReplicaUnavailableError: the server cannot be reached or is unavailable.
            ResponseTooLargeError: the answer was over ``max_response_bytes``.
        """
        body = await self._generate_body(request_id, prompt_ids, sampling_params, multi_modal_data)
        out = await self._request("POST", "/generate", json=body)
        extra = self._note_instance(out)
        return TokenOutput(token_ids=out["token_ids"], log_probs=out["log_probs"], stop_reason=out["stop_reason"],
                           extra=extra)

    async def generate_stream(self, request_id: str, prompt_ids: list[int],
                              sampling_params: Mapping[str, Any] | SamplingParams | None = None, *,
                              multi_modal_data: Mapping[str, Any] | None = None,
                              ) -> AsyncGenerator[TokenDelta, None]:
        """Generate on the remote server, yielding its tokens as it decodes them (a streamed
        ``POST /generate``, see :mod:`agentloop_engines.wire.stream`).

        The ids of the deltas, joined, are checked to be exactly the last delta's ``output``
        ids. ``timeout_s`` limits the wait for each record (the first one, then each gap), and
        ``max_response_bytes`` the whole stream. Closing the stream early closes its connection,
        which stops the request on the server. ``multi_modal_data`` as in :meth:`generate`.

        Raises:
            ValueError, PermissionError, ReplicaUnavailableError, ReplicaBusyError, TimeoutError:
                as :meth:`generate` raises them; before the first delta when the server refused
                the request, later when the engine failed or the connection dropped mid-stream
                (``ReplicaUnavailableError``).
        """
        what = f"POST {self.base_url}/generate"
        body = {**await self._generate_body(request_id, prompt_ids, sampling_params, multi_modal_data), "stream": True}
        try:
            async with self._client().stream("POST", "/generate", json=body) as response:
                bounded = self._bounded(response, what)
                if response.status_code >= 400:
                    self._checked(response, await bounded.read(response.aiter_raw()), what)
                instance = response.headers.get(INSTANCE_HEADER)
                if instance:
                    self.engine_instance = instance  # known before the first delta: a restart shows at once
                lines = bounded_lines(response.aiter_raw(), bounded)
                deltas = read_ndjson_deltas(lines, what, on_instance=self._note_instance,
                                            on_error=lambda record: self._stream_error(record, what),
                                            incomplete=ReplicaUnavailableError)
                async with contextlib.aclosing(deltas):
                    async for delta in deltas:
                        yield delta
        except self._httpx.TransportError as exc:
            raise self._transport_error(exc, what) from exc

    def _stream_error(self, record: Mapping[str, Any], what: str) -> Exception:
        error = record.get("error")
        if not isinstance(error, dict):
            error = {}
        message, code = f"{what}: {error.get('message')}", error.get("code")
        if code == "invalid_request":
            return ValueError(message)
        if code == "not_supported":
            return CapabilityNotSupportedError(message)
        return EngineHTTPError(f"{message} (the engine failed mid-stream)")

    async def abort(self, request_id: str) -> None:
        """Stop the remote server's in-flight requests of ``request_id``."""
        await self._control("POST", "/abort", json={"request_id": request_id})

    async def sleep(self) -> None:
        """Ask the remote server to release accelerator memory (501 -> CapabilityNotSupportedError)."""
        await self._control("POST", "/sleep")

    async def wake_up(self) -> None:
        """Ask the remote server to restore what ``sleep`` released."""
        await self._control("POST", "/wake_up")

    def forget_session(self, request_id: str) -> None:
        """Tell the remote server that the trajectory of ``request_id`` is over
        (``POST /forget_session``, see ``ServerCapabilities.forget_session``), without waiting:
        the ids go in batches from one task on the running event loop
        (:class:`~agentloop_engines.fleet.id_batches.IdBatches`), and :meth:`close` waits for
        what is still to send. A failure is logged, never raised: a lost hint costs the server
        memory until its bound ages the entry out, not the sample. Nothing is sent where the
        server does not declare ``forget_session`` (or its capabilities were never fetched),
        or outside a running event loop."""
        if self._health is not None and self._health["capabilities"].forget_session:
            self._forgets.add(request_id)

    async def _send_forgets(self, ids: list[str]) -> None:
        await self._request("POST", FORGET_SESSION_PATH, json={"request_ids": ids})

    async def update_weights(self, named_tensors: Iterable[tuple[str, Any]] | Mapping[str, Any]) -> None:
        """Send new weights to the remote server in one safetensors body (see :func:`serialize_weights`).

        Raises:
            CapabilityNotSupportedError: the server does not declare ``weight_update`` (checked before
                anything is serialised or sent).
            ValueError: the server refused the weights (an unknown name, a shape mismatch, or a
                body over its ``max_weights_bytes``).
        """
        if self._health is None:
            await self.connect()
        if not self.capabilities.weight_update:
            raise CapabilityNotSupportedError(f"the engine at {self.base_url} does not declare "
                                         "capabilities.weight_update; it cannot load new weights")
        # Serialising copies every tensor to host memory: keep that off the event loop.
        body = await asyncio.get_running_loop().run_in_executor(
            self._serializer, functools.partial(serialize_weights, named_tensors))
        out = await self._control("POST", "/update_weights", content=body,
                                  headers={"content-type": "application/octet-stream"})
        self._note_instance(out)

    async def _generate_body(self, request_id: str, prompt_ids: list[int],
                             sampling_params: Mapping[str, Any] | SamplingParams | None,
                             multi_modal_data: Mapping[str, Any] | None) -> dict[str, Any]:
        body = _generate_body(request_id, prompt_ids, sampling_params)
        images = images_of(multi_modal_data, engine=repr(self))
        if images:
            if self._health is None:
                await self.connect()
            if not self.capabilities.vision:
                raise CapabilityNotSupportedError(f"the engine server at {self.base_url} takes no images over /generate: "
                                                  f"{self._info()['no_images']}")
            # PNG-encoding a large image takes tens of milliseconds: off the event loop.
            body["images"] = await asyncio.get_running_loop().run_in_executor(
                self._image_encoder, encode_images, images)
        return body

    def _note_instance(self, out: Any) -> dict[str, Any]:
        instance = out.get("instance") if isinstance(out, dict) else None
        if not isinstance(instance, str):
            return {}
        self.engine_instance = instance
        return {"engine_instance": instance}

    async def close(self) -> None:
        """Close the connections. The remote server keeps running: this object does not own it."""
        loop = asyncio.get_running_loop()
        await self._forgets.drain()  # forget_session ids still to send go first
        http, self._http = self._http, None
        if http is not None and self._loop is loop:
            await http.aclose()

    async def __aenter__(self) -> EngineHTTPClient:
        await self.connect()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # ---- transport -----------------------------------------------------------------------

    def _client(self) -> Any:
        loop = asyncio.get_running_loop()
        if self._http is None or self._loop is not loop:
            # Connections belong to the loop that opened them; a client from another (perhaps
            # closed) loop cannot be used, or even closed, from this one.
            self._http = self._httpx.AsyncClient(base_url=self.base_url, headers=self._headers,
                                                 timeout=self._timeout, limits=self._limits)
            self._loop = loop
        return self._http

    async def _control(self, method: str, path: str, *, headers: Mapping[str, str] | None = None,
                       **kwargs: Any) -> Any:
        # A control route: the control key replaces the chat key (which never opens one).
        if not self._control_headers:  # no key: send no credential rather than the chat key
            headers = {**(headers or {}), "Authorization": ""}
        return await self._request(method, path, headers={**self._control_headers, **(headers or {})}, **kwargs)

    async def _request(self, method: str, path: str, **kwargs: Any) -> Any:
        what = f"{method} {self.base_url}{path}"
        try:
            # Streamed, never read whole: a server that sends without end is cut at max_response_bytes.
            async with self._client().stream(method, path, **kwargs) as response:
                body = await self._bounded(response, what).read(response.aiter_raw())
        except self._httpx.TransportError as exc:
            raise self._transport_error(exc, what) from exc
        return self._checked(response, body, what)

    def _bounded(self, response: Any, what: str) -> BoundedBody:
        bounded = BoundedBody(self.max_response_bytes, what)
        bounded.check_headers(response.headers)
        return bounded

    def _transport_error(self, exc: Exception, what: str) -> Exception:
        httpx = self._httpx
        if isinstance(exc, httpx.TimeoutException) and not isinstance(exc, httpx.ConnectTimeout):
            return TimeoutError(f"{what}: no response within timeout_s={self.timeout_s}s; the engine may be "
                                "hung or overloaded (raise timeout_s, or set LLMServerClient's request_timeout_s)")
        return ReplicaUnavailableError(f"{what} failed ({type(exc).__name__}: {str(exc) or 'no detail'}); is the "
                                       f"engine server running at {self.base_url}?")

    def _checked(self, response: Any, body: bytes, what: str) -> Any:
        status = response.status_code
        if status < 400:
            try:
                return json.loads(body)
            except ValueError as exc:
                raise EngineHTTPError(f"{what}: HTTP {status} with a body that is not JSON ({exc}): {body[:200]!r}; "
                                        "is it an agentloop engine server?") from None
        try:
            message = json.loads(body)["error"]["message"]
        except Exception:  # noqa: BLE001 - not our error shape (a proxy's page, say): show the text
            message = body[:500].decode("utf-8", errors="replace") or response.reason_phrase
        if status in (400, 413):
            raise ValueError(message)
        if status in (401, 403):
            code = error_code(body)
            if code in ("control_key_required", "control_disabled"):
                fix = ("the control_key given to EngineHTTPClient does not match the server's" if self._has_control_key
                       else "pass EngineHTTPClient(..., control_key=...) (the trainer: set "
                       "actor_rollout_ref.rollout.server_control_key_env)")
                if code == "control_disabled":
                    fix = ("start the server with a control key (`agentloop serve --control-key-env VAR`) and pass "
                           "the same key to EngineHTTPClient(..., control_key=...)")
            else:
                fix = ("the api_key given to EngineHTTPClient does not match the server's" if self.api_key else
                       "the server needs an API key: pass EngineHTTPClient(..., api_key=...)")
            raise PermissionError(f"{what}: {status} {message}; {fix}")
        if status == 501:
            raise CapabilityNotSupportedError(message)
        retry_after = _retry_after_s(response.headers.get("retry-after"))
        if status == 503 and retry_after is not None:
            raise ReplicaBusyError(f"{what}: HTTP 503: {message}", retry_after)
        if status in (502, 503, 504):
            raise ReplicaUnavailableError(f"{what}: HTTP {status}: {message}")
        hint = "; is it an agentloop engine server of a matching version?" if status == 404 else ""
        raise EngineHTTPError(f"{what}: HTTP {status}: {message}{hint}")


def _generate_body(request_id: str, prompt_ids: list[int],
                   sampling_params: Mapping[str, Any] | SamplingParams | None) -> dict[str, Any]:
    params = sampling_params.as_dict() if isinstance(sampling_params, SamplingParams) else dict(sampling_params or {})
    return {"request_id": request_id, "prompt_ids": [_token_id(t) for t in prompt_ids], "sampling_params": params}
