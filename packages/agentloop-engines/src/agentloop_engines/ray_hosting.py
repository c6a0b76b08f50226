"""Host engines and the client as Ray actors, for multi-process and multi-node rollouts.

* :class:`ServerActor` wraps any ``AsyncServer`` (built inside the actor by a factory, so the
  engine never has to be pickled) as an async actor; :func:`start_replicas` starts ``n`` named
  ones.
* :func:`client_actor` hosts one :class:`~agentloop_engines.client.LLMServerClient` as an async
  actor and returns a :class:`RemoteClient`, a small picklable proxy. Every AgentLoopWorker
  (often Ray actors themselves) gets a copy of the proxy, so all their requests go through the
  same routing state: least in-flight counts and sticky sessions are global, not per worker.

Ray is imported lazily; ``import agentloop_engines`` never imports it.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from agentloop_core.protocol import SamplingParams, ServerCapabilities, TokenOutput

__all__ = [
    "ClientActor",
    "RemoteClient",
    "ServerActor",
    "client_actor",
    "init_local_ray",
    "local_client",
    "start_replicas",
]


def _ray() -> Any:
    try:
        import ray
    except ImportError as exc:
        raise ImportError(
            'Ray hosting needs Ray: pip install "agentloop-engines[ray]"'
        ) from exc
    return ray


def init_local_ray(temp_dir: str | os.PathLike[str], *, num_cpus: int = 2, object_store_mb: int = 256,
                   **init_kwargs: Any) -> Any:
    """Start a local Ray cluster sized for a small machine (no dashboard, bounded object store,
    session files under ``temp_dir``, no auth token written to ``~/.ray``) and return ``ray``.

    Raises:
        ImportError: without Ray.
    """
    ray = _ray()
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    kwargs = dict(num_cpus=num_cpus, include_dashboard=False, object_store_memory=object_store_mb * 2**20,
                  _temp_dir=str(temp_dir), log_to_driver=False, **init_kwargs)
    try:
        ray.init(**kwargs)
    except Exception as exc:
        # Ray waits a hard-coded 30 s for its raylet; on a saturated 2-core machine that can run
        # out once. A second failure is real and raises.
        if "timed out during startup" not in str(exc):
            raise
        ray.shutdown()
        ray.init(**kwargs)
    return ray


class ServerActor:
    """Body of a Ray async actor serving one engine.

    Not used directly: :func:`start_replicas` wraps it with ``ray.remote``. Its methods mirror
    ``AsyncServer`` so :class:`~agentloop_engines.client.LLMServerClient` can route to it.

    Args:
        factory: Builds the engine inside the actor process (e.g. ``functools.partial(HFServer,
            path)``); called with ``*args, **kwargs``.
    """

    def __init__(self, factory: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        self.server = factory(*args, **kwargs)

    async def ready(self) -> dict[str, Any]:
        """Returns once the engine is built: its pid and size facts, for logs."""
        return {
            "pid": os.getpid(),
            "engine": type(self.server).__name__,
            "max_model_len": getattr(self.server, "max_model_len", None),
            "vocab_size": getattr(self.server, "vocab_size", None),
        }

    async def get_capabilities(self) -> ServerCapabilities:
        """The engine's declared capabilities."""
        return self.server.capabilities

    async def generate(self, request_id: str, prompt_ids: list[int],
                       sampling_params: Mapping[str, Any] | SamplingParams | None) -> TokenOutput:
        """See ``AsyncServer.generate``."""
        return await self.server.generate(request_id, prompt_ids, sampling_params)

    async def chat_completion(self, request: Mapping[str, Any]) -> dict[str, Any]:
        """See ``AsyncServerBase.chat_completion``."""
        return await self.server.chat_completion(request)

    async def abort(self, request_id: str) -> None:
        """See ``AsyncServer.abort``."""
        await self.server.abort(request_id)

    async def sleep(self) -> None:
        """See ``AsyncServer.sleep``."""
        await self.server.sleep()

    async def wake_up(self) -> None:
        """See ``AsyncServer.wake_up``."""
        await self.server.wake_up()

    async def update_weights(self, named_tensors: Iterable[tuple[str, Any]]) -> None:
        """See ``AsyncServer.update_weights``."""
        await self.server.update_weights(named_tensors)

    async def close(self) -> None:
        """Close the engine (if it has a ``close``)."""
        close = getattr(self.server, "close", None)
        if close is not None:
            await close()


def start_replicas(
    factory: Callable[..., Any],
    n: int,
    *,
    num_cpus: float = 0.25,
    num_gpus: float = 0,
    name_prefix: str = "agentloop-server",
    namespace: str | None = None,
    max_concurrency: int = 1000,
    ready_timeout_s: float = 300.0,
    factory_args: Sequence[Any] = (),
    factory_kwargs: Mapping[str, Any] | None = None,
) -> list[Any]:
    """Start ``n`` named engine replicas as Ray async actors and wait until they are built.

    Args:
        factory: Builds one engine inside its actor; must be importable by Ray workers (a
            class or a module-level function, or a ``functools.partial`` of one).
        n: Number of replicas.
        num_cpus: CPUs each actor reserves. Fractional by default: an actor whose request
            cannot be met stays pending forever without an error.
        num_gpus: GPUs each actor reserves.
        name_prefix: Actors are named ``f"{name_prefix}-{i}"`` so other processes can find
            them with ``ray.get_actor``.
        namespace: Ray namespace of the named actors (None: the job's).
        max_concurrency: Requests one actor runs concurrently (the engine batches them).
        ready_timeout_s: How long to wait for all engines to build.
        factory_args: Positional arguments for ``factory``.
        factory_kwargs: Keyword arguments for ``factory``.

    Returns:
        The actor handles, in replica order.

    Raises:
        ImportError: when Ray is not installed.
        ValueError: on ``n < 1`` or a name already taken.
        TimeoutError: when the replicas are not ready in time (often: not enough free CPUs/GPUs).
    """
    ray = _ray()
    if n < 1:
        raise ValueError(f"start_replicas needs n >= 1, got {n}")
    if not ray.is_initialized():
        raise RuntimeError("Ray is not initialised; call ray.init(...) before start_replicas")
    actor_cls = _remote_class(ServerActor)
    handles = []
    for i in range(n):
        name = f"{name_prefix}-{i}"
        try:
            handle = actor_cls.options(
                name=name, namespace=namespace, num_cpus=num_cpus, num_gpus=num_gpus,
                max_concurrency=max_concurrency,
            ).remote(factory, *factory_args, **dict(factory_kwargs or {}))
        except ValueError as exc:
            for h in handles:
                ray.kill(h)
            raise ValueError(
                f"cannot create replica actor {name!r}: {exc}; pick another name_prefix or "
                "ray.kill the old replicas first"
            ) from exc
        handles.append(handle)
    try:
        ray.get([h.ready.remote() for h in handles], timeout=ready_timeout_s)
    except ray.exceptions.GetTimeoutError as exc:
        for h in handles:
            ray.kill(h)
        raise TimeoutError(
            f"{n} replicas were not ready after {ready_timeout_s}s; each asks for num_cpus={num_cpus}, "
            f"num_gpus={num_gpus} - check ray.available_resources() and the actor logs"
        ) from exc
    return handles


def local_client(handles: Sequence[Any], **client_kwargs: Any) -> Any:
    """An in-process :class:`~agentloop_engines.client.LLMServerClient` over replica handles.

    Use it when a single process sends all requests; use :func:`client_actor` when several
    workers must share one routing view.
    """
    from agentloop_engines.client import LLMServerClient

    return LLMServerClient(list(handles), **client_kwargs)


class ClientActor:
    """Body of the Ray async actor hosting one shared ``LLMServerClient``."""

    def __init__(self, handles: Sequence[Any], client_kwargs: Mapping[str, Any]) -> None:
        from agentloop_engines.client import LLMServerClient

        self.client = LLMServerClient(list(handles), **dict(client_kwargs))

    async def get_capabilities(self) -> ServerCapabilities:
        return self.client.capabilities

    async def generate(self, request_id: str, prompt_ids: list[int],
                       sampling_params: Mapping[str, Any] | SamplingParams | None) -> TokenOutput:
        return await self.client.generate(request_id, prompt_ids, sampling_params)

    async def chat_completion(self, request: Mapping[str, Any]) -> dict[str, Any]:
        return await self.client.chat_completion(request)

    async def abort(self, request_id: str) -> None:
        await self.client.abort(request_id)

    async def sleep(self) -> None:
        await self.client.sleep()

    async def wake_up(self) -> None:
        await self.client.wake_up()

    async def update_weights(self, named_tensors: Iterable[tuple[str, Any]]) -> None:
        await self.client.update_weights(named_tensors)

    async def stats(self) -> dict[str, Any]:
        return self.client.stats

    async def mark_healthy(self, index: int) -> None:
        self.client.mark_healthy(index)

    async def forget_session(self, request_id: str) -> None:
        self.client.forget_session(request_id)


class RemoteClient:
    """Picklable proxy to a :class:`ClientActor`; an ``AsyncServer`` for agent loops.

    Copies of one proxy (in any process of the Ray cluster) share the actor's routing state.

    Args:
        actor: Handle of a ClientActor.
        capabilities: The client's capabilities (fetched once by :func:`client_actor`).
    """

    def __init__(self, actor: Any, capabilities: ServerCapabilities) -> None:
        self.actor = actor
        self.capabilities = capabilities

    @classmethod
    def from_name(cls, name: str, *, namespace: str | None = None, timeout_s: float = 60.0) -> RemoteClient:
        """Connect to a client actor started with ``client_actor(..., name=name)``."""
        ray = _ray()
        actor = ray.get_actor(name, namespace=namespace)
        return cls(actor, ray.get(actor.get_capabilities.remote(), timeout=timeout_s))

    async def generate(self, request_id: str, prompt_ids: list[int],
                       sampling_params: Mapping[str, Any] | SamplingParams | None = None) -> TokenOutput:
        """See :meth:`LLMServerClient.generate`."""
        # Validate here too: the error then points at the caller's line, not a Ray traceback.
        sp = SamplingParams.from_mapping(sampling_params)
        return await self.actor.generate.remote(request_id, list(prompt_ids), sp)

    async def chat_completion(self, request: Mapping[str, Any]) -> dict[str, Any]:
        """See :meth:`LLMServerClient.chat_completion`."""
        return await self.actor.chat_completion.remote(dict(request))

    async def abort(self, request_id: str) -> None:
        """See :meth:`LLMServerClient.abort`."""
        await self.actor.abort.remote(request_id)

    async def sleep(self) -> None:
        """See :meth:`LLMServerClient.sleep`."""
        await self.actor.sleep.remote()

    async def wake_up(self) -> None:
        """See :meth:`LLMServerClient.wake_up`."""
        await self.actor.wake_up.remote()

    async def update_weights(self, named_tensors: Iterable[tuple[str, Any]]) -> None:
        """See :meth:`LLMServerClient.update_weights`."""
        await self.actor.update_weights.remote(list(named_tensors))

    async def get_stats(self) -> dict[str, Any]:
        """The shared client's ``stats`` snapshot (routing counters, in-flight, health)."""
        return await self.actor.stats.remote()

    async def mark_healthy(self, index: int) -> None:
        """Put a replica back into the shared client's rotation."""
        await self.actor.mark_healthy.remote(index)


def client_actor(
    handles: Sequence[Any],
    *,
    name: str | None = None,
    namespace: str | None = None,
    num_cpus: float = 0.1,
    max_concurrency: int = 10000,
    ready_timeout_s: float = 120.0,
    **client_kwargs: Any,
) -> RemoteClient:
    """Host an ``LLMServerClient`` over ``handles`` as a Ray actor and return its proxy.

    Args:
        handles: ServerActor handles (e.g. from :func:`start_replicas`).
        name: Optional actor name, so other drivers can :meth:`RemoteClient.from_name` it.
        namespace: Ray namespace of the named actor.
        num_cpus: CPUs reserved by the client actor (it only routes).
        max_concurrency: Requests it routes concurrently; bound it above the total number of
            trajectories in flight, or requests queue inside Ray, invisible to the balancer.
        ready_timeout_s: How long to wait for the actor to start.
        **client_kwargs: Passed to ``LLMServerClient`` (``imbalance_threshold``,
            ``request_timeout_s``, ...).

    Returns:
        A picklable :class:`RemoteClient`.
    """
    ray = _ray()
    actor = _remote_class(ClientActor).options(
        name=name, namespace=namespace, num_cpus=num_cpus, max_concurrency=max_concurrency
    ).remote(list(handles), client_kwargs)
    try:
        caps = ray.get(actor.get_capabilities.remote(), timeout=ready_timeout_s)
    except ray.exceptions.GetTimeoutError as exc:
        ray.kill(actor)
        raise TimeoutError(
            f"client actor not ready after {ready_timeout_s}s (num_cpus={num_cpus}); check "
            "ray.available_resources()"
        ) from exc
    return RemoteClient(actor, caps)


@functools.cache
def _remote_class(cls: type) -> Any:
    return _ray().remote(cls)
