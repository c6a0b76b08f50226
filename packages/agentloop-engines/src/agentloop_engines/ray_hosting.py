"""Host engines and the client as Ray actors, for multi-process and multi-node rollouts.

* :class:`ServerActor` wraps any ``AsyncServer`` (built inside the actor by a factory, so the
  engine never has to be pickled) as an async actor; :func:`start_replicas` starts ``n`` named
  ones.
* :func:`client_actor` hosts one :class:`~agentloop_engines.client.LLMServerClient` as an async
  actor and returns a :class:`RemoteClient`, a small picklable proxy. Every AgentLoopWorker
  (often Ray actors themselves) gets a copy of the proxy, so all their requests go through the
  same routing state: least in-flight counts and sticky sessions are global, not per worker.
* Multi-node: :func:`start_replicas` can reserve a placement group (PACK / SPREAD / STRICT_*)
  after checking the cluster can hold it; :func:`find_replicas` finds named replicas from any
  node; :func:`replica_nodes` tells where they run; :func:`stop_replicas` cleans up. Joining a
  cluster, resource checks and rank placement live in :mod:`agentloop_engines.placement` and
  are re-exported here.

Ray is imported lazily; ``import agentloop_engines`` never imports it.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from agentloop_core.protocol import SamplingParams, ServerCapabilities, TokenOutput
from agentloop_engines.placement import (
    PLACEMENT_STRATEGIES,
    InsufficientResourcesError,
    bundle_for,
    check_resources,
    connect_ray,
    create_placement_group,
    init_local_ray,
    placement_group_for_ranks,
    rank_scheduling_strategy,
    remove_placement_group,
)

logger = logging.getLogger(__name__)

__all__ = [
    "PLACEMENT_STRATEGIES",
    "ClientActor",
    "InsufficientResourcesError",
    "RemoteClient",
    "ServerActor",
    "check_resources",
    "client_actor",
    "connect_ray",
    "find_replicas",
    "init_local_ray",
    "local_client",
    "placement_group_for_ranks",
    "rank_scheduling_strategy",
    "remove_placement_group",
    "replica_nodes",
    "start_replicas",
    "stop_replicas",
]

# Placement groups reserved by start_replicas in this process, by name prefix, so
# stop_replicas(handles) can release them too (by prefix they are also found by name).
_REPLICA_GROUPS: dict[str, Any] = {}


def _ray() -> Any:
    try:
        import ray
    except ImportError as exc:
        raise ImportError(
            'Ray hosting needs Ray: pip install "agentloop-engines[ray]"'
        ) from exc
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
        """Returns once the engine is built: its pid, Ray node id and size facts, for logs."""
        import ray

        return {
            "pid": os.getpid(),
            "node_id": ray.get_runtime_context().get_node_id(),
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
    placement_strategy: str | None = None,
    placement_timeout_s: float = 120.0,
    resources: Mapping[str, float] | None = None,
) -> list[Any]:
    """Start ``n`` named engine replicas as Ray async actors and wait until they are built.

    The cluster's resources are checked first (:func:`check_resources`), so a request that can
    never be met fails at once with a message naming the missing resource instead of leaving
    actors pending. With ``placement_strategy`` the replicas also get a placement group with
    one bundle per replica (replica ``i`` in bundle ``i``), reserved before any actor starts.

    Args:
        factory: Builds one engine inside its actor; must be importable by Ray workers (a
            class or a module-level function, or a ``functools.partial`` of one).
        n: Number of replicas.
        num_cpus: CPUs each actor reserves. Fractional by default: an actor whose request
            cannot be met stays pending forever without an error.
        num_gpus: GPUs each actor reserves (tensor parallel size x GPUs per shard).
        name_prefix: Actors are named ``f"{name_prefix}-{i}"`` so other processes (a worker on
            another node) can find them with :func:`find_replicas`.
        namespace: Ray namespace of the named actors (None: the job's).
        max_concurrency: Requests one actor runs concurrently (the engine batches them).
        ready_timeout_s: How long to wait for all engines to build.
        factory_args: Positional arguments for ``factory``.
        factory_kwargs: Keyword arguments for ``factory``.
        placement_strategy: None (Ray places each actor) or ``"PACK"``, ``"SPREAD"``,
            ``"STRICT_PACK"``, ``"STRICT_SPREAD"`` (a placement group named
            ``f"{name_prefix}-pg"``; SPREAD puts replicas on different nodes when it can).
        placement_timeout_s: How long to wait for the placement group to be reserved.
        resources: Custom Ray resources each replica reserves (e.g. ``{"gpu_node": 1}``, to pin
            replicas to nodes started with that resource).

    Returns:
        The actor handles, in replica order.

    Raises:
        ImportError: when Ray is not installed.
        ValueError: on ``n < 1``, a name already taken, or an unknown strategy.
        InsufficientResourcesError: the cluster cannot hold the replicas (nothing was started).
        TimeoutError: when the replicas are not ready in time.
    """
    ray = _ray()
    if n < 1:
        raise ValueError(f"start_replicas needs n >= 1, got {n}")
    if not ray.is_initialized():
        raise RuntimeError("Ray is not initialised; call connect_ray(...) or ray.init(...) before start_replicas")
    bundle = bundle_for(num_cpus, num_gpus, resources)
    what = f"{n} engine replica(s) x {bundle}"
    fix = ("lower actor_rollout_ref.rollout.num_replicas or ray.replica_num_cpus / ray.replica_num_gpus, "
           "pick another ray.placement_strategy, or add nodes")
    options: list[dict[str, Any]] = [{} for _ in range(n)]
    pg = None
    if placement_strategy is None:
        check_resources([bundle] * n, strategy="PACK", what=what, fix=fix)
    else:
        pg = create_placement_group([bundle] * n, strategy=placement_strategy, timeout_s=placement_timeout_s,
                                    what=what, fix=fix, name=f"{name_prefix}-pg")
        options = [{"scheduling_strategy": rank_scheduling_strategy(pg, i)} for i in range(n)]
    actor_cls = _remote_class(ServerActor)
    handles: list[Any] = []

    def cleanup() -> None:
        for h in handles:
            ray.kill(h)
        if pg is not None:
            remove_placement_group(pg)

    for i in range(n):
        name = f"{name_prefix}-{i}"
        try:
            handle = actor_cls.options(
                name=name, namespace=namespace, num_cpus=num_cpus, num_gpus=num_gpus,
                resources=dict(resources or {}) or None, max_concurrency=max_concurrency, **options[i],
            ).remote(factory, *factory_args, **dict(factory_kwargs or {}))
        except ValueError as exc:
            cleanup()
            raise ValueError(
                f"cannot create replica actor {name!r}: {exc}; pick another name_prefix or "
                "stop_replicas the old replicas first"
            ) from exc
        handles.append(handle)
    try:
        ray.get([h.ready.remote() for h in handles], timeout=ready_timeout_s)
    except ray.exceptions.GetTimeoutError as exc:
        cleanup()
        raise TimeoutError(
            f"{n} replicas were not ready after {ready_timeout_s}s; each asks for num_cpus={num_cpus}, "
            f"num_gpus={num_gpus} - check ray.available_resources() and the actor logs"
        ) from exc
    if pg is not None:
        _REPLICA_GROUPS[name_prefix] = (pg, [h._actor_id.hex() for h in handles])
    return handles


def find_replicas(
    name_prefix: str = "agentloop-server",
    *,
    namespace: str | None = None,
    timeout_s: float = 60.0,
    expected: int | None = None,
) -> list[Any]:
    """Handles of the named replicas ``f"{name_prefix}-0"``, ``-1``, ... (from any node).

    Args:
        name_prefix: The prefix given to :func:`start_replicas`.
        namespace: Their Ray namespace (None: this job's).
        timeout_s: How long to wait for them to be registered (a worker may start first).
        expected: Wait until this many are found (None: at least one, then take all with
            consecutive indices).

    Returns:
        The handles, in replica order.

    Raises:
        LookupError: when none (or fewer than ``expected``) appear within ``timeout_s``.
    """
    ray = _ray()
    deadline = time.monotonic() + timeout_s
    while True:
        handles = []
        while True:
            try:
                handles.append(ray.get_actor(f"{name_prefix}-{len(handles)}", namespace=namespace))
            except ValueError:
                break
        if handles and (expected is None or len(handles) >= expected):
            return handles[:expected] if expected else handles
        if time.monotonic() >= deadline:
            raise LookupError(
                f"found {len(handles)} replica(s) named {name_prefix!r}-<i> in namespace {namespace!r} "
                f"after {timeout_s}s (expected {expected or 'at least 1'}); start them with "
                "start_replicas(..., name_prefix=...) and join the same Ray namespace"
            )
        time.sleep(0.2)


def replica_nodes(handles: Sequence[Any], *, timeout_s: float = 60.0) -> list[str]:
    """The Ray node id of each replica, in order (from ``ServerActor.ready``)."""
    ray = _ray()
    infos = ray.get([h.ready.remote() for h in handles], timeout=timeout_s)
    return [info["node_id"] for info in infos]


def stop_replicas(handles_or_name_prefix: Sequence[Any] | str, *, namespace: str | None = None) -> int:
    """Kill replicas and release their placement group.

    Args:
        handles_or_name_prefix: Handles from :func:`start_replicas`, or their ``name_prefix``
            (then the replicas and the group ``f"{prefix}-pg"`` are found by name).
        namespace: Ray namespace of named replicas.

    Returns:
        How many replicas were killed.
    """
    ray = _ray()
    if isinstance(handles_or_name_prefix, str):
        prefix = handles_or_name_prefix
        try:
            handles = find_replicas(prefix, namespace=namespace, timeout_s=0)
        except LookupError:
            handles = []
        entry = _REPLICA_GROUPS.pop(prefix, None)
        pg = entry[0] if entry else _named_group(ray, f"{prefix}-pg")
        groups = [pg] if pg is not None else []
    else:
        handles = list(handles_or_name_prefix)
        ids = {h._actor_id.hex() for h in handles}
        groups = []
        for prefix, (pg, actor_ids) in list(_REPLICA_GROUPS.items()):
            if ids & set(actor_ids):
                groups.append(pg)
                del _REPLICA_GROUPS[prefix]
    for h in handles:
        try:
            ray.kill(h)
        except Exception as exc:  # noqa: BLE001 - a replica lost with its node is already gone
            logger.debug("ray.kill of a replica failed: %s", exc)
    for pg in groups:
        remove_placement_group(pg)
    return len(handles)


def _named_group(ray: Any, name: str) -> Any:
    try:
        return ray.util.get_placement_group(name)
    except ValueError:
        return None


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
    node_id: str | None = None,
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
        node_id: Pin the actor to this node (hard affinity), e.g. the driver's own
            (``ray.get_runtime_context().get_node_id()``): every request goes through it, so it
            should live where losing it loses the run anyway, not on a worker node.
        **client_kwargs: Passed to ``LLMServerClient`` (``imbalance_threshold``,
            ``request_timeout_s``, ...).

    Returns:
        A picklable :class:`RemoteClient`.
    """
    ray = _ray()
    options: dict[str, Any] = {}
    if node_id is not None:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node_id, soft=False)
    actor = _remote_class(ClientActor).options(
        name=name, namespace=namespace, num_cpus=num_cpus, max_concurrency=max_concurrency, **options
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
