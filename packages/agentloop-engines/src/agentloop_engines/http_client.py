"""``RemoteServer``: an ``AsyncServer`` client of a remote agentloop HTTP server (``/generate``).

Put it in :class:`~agentloop_engines.client.LLMServerClient` to balance over engine replicas
that run elsewhere (other hosts, or servers a trainer did not start)::

    client = LLMServerClient([RemoteServer("http://gpu-0:8000", api_key=key, control_key=control),
                              RemoteServer("http://gpu-1:8000", api_key=key, control_key=control)])

It speaks the endpoints of :mod:`agentloop_engines.http_server`: ``generate`` with the
``api_key`` (and ``generate_stream``, its streamed form: :mod:`agentloop_engines.http_stream`), and the control calls (``abort``, ``sleep``, ``wake_up``, ``update_weights``) with
the ``control_key`` (see :mod:`agentloop_engines.control`). It raises what an in-process
engine would: 400 and 413 -> ``ValueError`` (the server's message), 401 and 403 -> ``PermissionError``,
501 -> ``CapabilityNotSupportedError``, 500 and unexpected statuses -> :class:`RemoteServerError`.
A server that cannot be reached, a dropped connection, 502/503/504 ->
:class:`ReplicaUnavailableError`, a ``ConnectionError``, so ``LLMServerClient`` takes the replica
out of rotation and retries the request elsewhere; a read timeout (only with ``timeout_s``) ->
``TimeoutError``, which it treats as it treats its own ``request_timeout_s``. A 503 with
``Retry-After`` (the server's in-flight limit) -> :class:`ReplicaBusyError`: backpressure, which
``LLMServerClient`` answers by going elsewhere or waiting, never by taking the replica out.

Needs the ``[server]`` extra (httpx); ``update_weights`` also needs torch and safetensors
(the ``[hf]`` extra).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
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
from agentloop_engines.http_stream import INSTANCE_HEADER, read_ndjson_deltas
from agentloop_engines.streaming import TokenDelta

__all__ = ["RemoteServer", "RemoteServerError", "ReplicaBusyError", "ReplicaUnavailableError", "serialize_weights"]


class ReplicaUnavailableError(ConnectionError):
    """The engine server cannot be reached or says it is unavailable (refused or dropped
    connection, 502/503/504). A ``ConnectionError``: ``LLMServerClient`` fails over on it."""


class ReplicaBusyError(ReplicaUnavailableError):
    """The engine server is at its in-flight limit (503 with ``Retry-After``): it is alive and
    will serve again shortly. ``LLMServerClient`` sends the request elsewhere or waits
    ``retry_after_s``, and keeps the replica in rotation."""

    def __init__(self, message: str, retry_after_s: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s
        """How long the server asked the client to wait (its ``Retry-After``)."""


class RemoteServerError(RuntimeError):
    """The engine server failed the request (500 with the engine's error, or a status the
    agentloop server does not use). Not a replica failure: the request is not retried."""


def _require_httpx() -> Any:
    try:
        import httpx
    except ImportError as exc:
        raise ImportError('RemoteServer needs httpx: pip install "agentloop-engines[server]"') from exc
    return httpx


def _token_id(t: Any) -> Any:
    # numpy/torch integers are valid ids but not JSON; anything else goes as is and the
    # server answers 400 naming the bad position, as an in-process engine would.
    return int(t) if hasattr(t, "__index__") and not isinstance(t, bool) else t


def serialize_weights(named_tensors: Iterable[tuple[str, Any]] | Mapping[str, Any]) -> bytes:
    """Pack named tensors into one safetensors archive (the ``POST /update_weights`` body).

    Tensors are detached, moved to the CPU and made contiguous. safetensors refuses tensors
    that share storage (tied embeddings, views of one buffer), so every tensor after the first
    on a storage is copied; a repeated name keeps its last tensor, as loading in order would.

    Raises:
        ImportError: without torch and safetensors.
    """
    try:
        import torch
        from safetensors.torch import save
    except ImportError as exc:
        raise ImportError(f'update_weights over HTTP needs {exc.name}: pip install "agentloop-engines[hf]"') from exc
    items = named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors
    tensors: dict[str, Any] = {}
    storages: set[int] = set()
    for name, value in items:
        t = torch.as_tensor(value).detach().cpu().contiguous()
        if t.untyped_storage().data_ptr() in storages:
            t = t.clone()
        storages.add(t.untyped_storage().data_ptr())
        tensors[str(name)] = t
    return save(tensors)


class RemoteServer:
    """An ``AsyncServer`` over HTTP: every call is a request to a remote server.

    Capabilities, ``max_model_len`` and ``vocab_size`` come from the server's ``GET /health``,
    fetched once: by ``await connect()``, or on first access of those attributes (a blocking
    request; inside a running event loop, ``await connect()`` first). Connections are opened
    lazily on the running event loop, so a ``RemoteServer`` may be created outside one and used
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

    Raises:
        ValueError: on a ``base_url`` that is not http(s), an empty ``api_key`` or
            ``control_key``, or a non-positive limit.
    """

    def __init__(self, base_url: str, *, api_key: str | None = None, timeout_s: float | None = None,
                 connect_timeout_s: float = 10.0, max_connections: int = 256,
                 control_key: str | None = None) -> None:
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
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
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
        self._loop: asyncio.AbstractEventLoop | None = None

    def __repr__(self) -> str:
        return f"RemoteServer({self.base_url!r})"

    # ---- what the server declares --------------------------------------------------------

    async def connect(self) -> ServerCapabilities:
        """Fetch ``/health`` (without blocking the event loop) and return the capabilities.

        Raises:
            ReplicaUnavailableError: when the server cannot be reached.
        """
        self._health = self._parse_health(await self._request("GET", "/health", timeout=self.connect_timeout_s))
        return self._health["capabilities"]

    def _info(self) -> dict[str, Any]:
        if self._health is None:
            url = f"{self.base_url}/health"
            try:
                response = self._httpx.get(url, timeout=self.connect_timeout_s)
            except self._httpx.TransportError as exc:
                raise self._transport_error(exc, f"GET {url}") from exc
            self._health = self._parse_health(self._checked(response, f"GET {url}"))
        return self._health

    def _parse_health(self, body: Any) -> dict[str, Any]:
        caps = body.get("capabilities") if isinstance(body, dict) else None
        if not isinstance(caps, dict):
            raise RemoteServerError(f"{self.base_url}/health has no capabilities; is it an agentloop engine "
                                    "server (agentloop_engines.http_server)?")
        # Flags a newer server adds are ignored; ones it lacks keep their defaults. Images do not
        # travel over /generate (yet), so this client never declares vision, whatever it serves.
        known = {f.name for f in fields(ServerCapabilities)} - {"vision"}
        return {"capabilities": ServerCapabilities(**{k: bool(v) for k, v in caps.items() if k in known}),
                "max_model_len": body.get("max_model_len"), "vocab_size": body.get("vocab_size")}

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
                       sampling_params: Mapping[str, Any] | SamplingParams | None = None) -> TokenOutput:
        """Generate on the remote server (see ``AsyncServer.generate``).

        Sampling parameters are validated by the server, which is the authority on them.

        Raises:
            ValueError: the server rejected the request (its message, e.g. an unknown key).
            PermissionError: a missing or wrong ``api_key``.
            ReplicaUnavailableError: the server cannot be reached or is unavailable.
        """
        out = await self._request("POST", "/generate", json=_generate_body(request_id, prompt_ids, sampling_params))
        extra = self._note_instance(out)
        return TokenOutput(token_ids=out["token_ids"], log_probs=out["log_probs"], stop_reason=out["stop_reason"],
                           extra=extra)

    async def generate_stream(self, request_id: str, prompt_ids: list[int],
                              sampling_params: Mapping[str, Any] | SamplingParams | None = None,
                              ) -> AsyncGenerator[TokenDelta, None]:
        """Generate on the remote server, yielding its tokens as it decodes them (a streamed
        ``POST /generate``, see :mod:`agentloop_engines.http_stream`).

        The ids of the deltas, joined, are checked to be exactly the last delta's ``output``
        ids. ``timeout_s`` limits the wait for each record (the first one, then each gap).
        Closing the stream early closes its connection, which stops the request on the server.

        Raises:
            ValueError, PermissionError, ReplicaUnavailableError, ReplicaBusyError, TimeoutError:
                as :meth:`generate` raises them; before the first delta when the server refused
                the request, later when the engine failed or the connection dropped mid-stream
                (``ReplicaUnavailableError``).
        """
        what = f"POST {self.base_url}/generate"
        body = {**_generate_body(request_id, prompt_ids, sampling_params), "stream": True}
        try:
            async with self._client().stream("POST", "/generate", json=body) as response:
                if response.status_code >= 400:
                    await response.aread()
                    self._checked(response, what)
                instance = response.headers.get(INSTANCE_HEADER)
                if instance:
                    self.engine_instance = instance  # known before the first delta: a restart shows at once
                deltas = read_ndjson_deltas(response.aiter_lines(), what, on_instance=self._note_instance,
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
        return RemoteServerError(f"{message} (the engine failed mid-stream)")

    async def abort(self, request_id: str) -> None:
        """Stop the remote server's in-flight requests of ``request_id``."""
        await self._control("POST", "/abort", json={"request_id": request_id})

    async def sleep(self) -> None:
        """Ask the remote server to release accelerator memory (501 -> CapabilityNotSupportedError)."""
        await self._control("POST", "/sleep")

    async def wake_up(self) -> None:
        """Ask the remote server to restore what ``sleep`` released."""
        await self._control("POST", "/wake_up")

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

    def _note_instance(self, out: Any) -> dict[str, Any]:
        instance = out.get("instance") if isinstance(out, dict) else None
        if not isinstance(instance, str):
            return {}
        self.engine_instance = instance
        return {"engine_instance": instance}

    async def close(self) -> None:
        """Close the connections. The remote server keeps running: this object does not own it."""
        http, self._http = self._http, None
        loop = asyncio.get_running_loop()
        if http is not None and self._loop is loop:
            await http.aclose()

    async def __aenter__(self) -> RemoteServer:
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
            response = await self._client().request(method, path, **kwargs)
        except self._httpx.TransportError as exc:
            raise self._transport_error(exc, what) from exc
        return self._checked(response, what)

    def _transport_error(self, exc: Exception, what: str) -> Exception:
        httpx = self._httpx
        if isinstance(exc, httpx.TimeoutException) and not isinstance(exc, httpx.ConnectTimeout):
            return TimeoutError(f"{what}: no response within timeout_s={self.timeout_s}s; the engine may be "
                                "hung or overloaded (raise timeout_s, or set LLMServerClient's request_timeout_s)")
        return ReplicaUnavailableError(f"{what} failed ({type(exc).__name__}: {str(exc) or 'no detail'}); is the "
                                       f"engine server running at {self.base_url}?")

    def _checked(self, response: Any, what: str) -> Any:
        status = response.status_code
        if status < 400:
            return response.json()
        try:
            message = response.json()["error"]["message"]
        except Exception:  # noqa: BLE001 - not our error shape (a proxy's page, say): show the text
            message = response.text[:500] or response.reason_phrase
        if status in (400, 413):
            raise ValueError(message)
        if status in (401, 403):
            code = _error_code(response)
            if code in ("control_key_required", "control_disabled"):
                fix = ("the control_key given to RemoteServer does not match the server's" if self._has_control_key
                       else "pass RemoteServer(..., control_key=...) (the trainer: set "
                       "actor_rollout_ref.rollout.server_control_key_env)")
                if code == "control_disabled":
                    fix = ("start the server with a control key (`agentloop serve --control-key-env VAR`) and pass "
                           "the same key to RemoteServer(..., control_key=...)")
            else:
                fix = ("the api_key given to RemoteServer does not match the server's" if self.api_key else
                       "the server needs an API key: pass RemoteServer(..., api_key=...)")
            raise PermissionError(f"{what}: {status} {message}; {fix}")
        if status == 501:
            raise CapabilityNotSupportedError(message)
        retry_after = _retry_after_s(response.headers.get("retry-after"))
        if status == 503 and retry_after is not None:
            raise ReplicaBusyError(f"{what}: HTTP 503: {message}", retry_after)
        if status in (502, 503, 504):
            raise ReplicaUnavailableError(f"{what}: HTTP {status}: {message}")
        hint = "; is it an agentloop engine server of a matching version?" if status == 404 else ""
        raise RemoteServerError(f"{what}: HTTP {status}: {message}{hint}")


def _generate_body(request_id: str, prompt_ids: list[int],
                   sampling_params: Mapping[str, Any] | SamplingParams | None) -> dict[str, Any]:
    params = sampling_params.as_dict() if isinstance(sampling_params, SamplingParams) else dict(sampling_params or {})
    return {"request_id": request_id, "prompt_ids": [_token_id(t) for t in prompt_ids], "sampling_params": params}


def _retry_after_s(value: str | None) -> float | None:
    # Only the delta-seconds form: the agentloop servers send it; an HTTP-date (a proxy's) or
    # garbage is not an in-flight limit this client knows, so it stays a plain 503. Capped so
    # that a hostile or careless header cannot park a request for hours.
    try:
        seconds = float(value) if value is not None else None
    except ValueError:
        return None
    if seconds is None or not 0 <= seconds < float("inf"):
        return None
    return min(seconds, 30.0)


def _error_code(response: Any) -> str | None:
    try:
        return response.json()["error"]["code"]
    except Exception:  # noqa: BLE001 - not our error shape
        return None
