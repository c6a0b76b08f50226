"""Engine replicas as Ray actors: start them, find them by name, see where they run, stop them.

* :class:`ReplicaActor` wraps any ``AsyncServer`` (built inside the actor by a factory, so the
  engine never has to be pickled) as an async actor; :func:`start_replicas` starts ``n`` named
  ones, optionally in a placement group (PACK / SPREAD / STRICT_*), after checking that the
  cluster can hold them.
* :func:`start_replicas` and :func:`find_replicas` return a :class:`ReplicaSet`: the handles
  (a ``list``) plus the name prefix and placement group :func:`stop_replicas` must release.
  Nothing is remembered in the process, so a driver that did not start the replicas stops them
  just as well (by name prefix).

Ray is imported lazily; ``import agentloop_engines`` never imports it.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from agentloop_core.protocol import ServerCapabilities
from agentloop_core.server_wrapper import ServerWrapper
from agentloop_engines.fleet.hosting.cluster import _remote_class, import_ray
from agentloop_engines.fleet.hosting.placement import (
    bundle_for,
    check_resources,
    create_placement_group,
    rank_scheduling_strategy,
    remove_placement_group,
)

logger = logging.getLogger(__name__)

__all__ = ["ReplicaSet", "ReplicaActor", "find_replicas", "replica_nodes", "start_replicas", "stop_replicas"]

_PURPOSE = "Ray hosting"


class ReplicaSet(list):
    """Replica actor handles in replica order (a plain ``list`` to every caller), plus what
    :func:`stop_replicas` needs to release them.

    Slicing or copying gives a plain ``list``: the placement group belongs to the whole set.

    Args:
        handles: The actor handles, replica ``i`` named ``f"{name_prefix}-{i}"``.
        name_prefix: Their name prefix.
        namespace: Their Ray namespace (None: the job's).
        placement_group: The group reserved for them (named ``f"{name_prefix}-pg"``), or None.
    """

    def __init__(self, handles: Iterable[Any] = (), *, name_prefix: str, namespace: str | None = None,
                 placement_group: Any = None) -> None:
        super().__init__(handles)
        self.name_prefix = name_prefix
        self.namespace = namespace
        self.placement_group = placement_group

    def __repr__(self) -> str:
        group = "" if self.placement_group is None else f", placement group {self.name_prefix}-pg"
        return f"ReplicaSet({len(self)} x {self.name_prefix!r}-<i>{group})"


class ReplicaActor(ServerWrapper):
    """Body of a Ray async actor serving one engine.

    Not used directly: :func:`start_replicas` wraps it with ``ray.remote``. Its methods mirror
    ``AsyncServer`` so :class:`~agentloop_engines.fleet.client.LLMServerClient` can route to it.

    Args:
        factory: Builds the engine inside the actor process (e.g. ``functools.partial(HFServer,
            path)``); called with ``*args, **kwargs``.
    """

    def __init__(self, factory: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        super().__init__(factory(*args, **kwargs))

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
) -> ReplicaSet:
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
        The actor handles, in replica order, as a :class:`ReplicaSet` (with the placement group,
        if any); pass it to :func:`stop_replicas`.

    Raises:
        ImportError: when Ray is not installed.
        ValueError: on ``n < 1``, a name already taken, or an unknown strategy.
        InsufficientResourcesError: the cluster cannot hold the replicas (nothing was started).
        TimeoutError: when the replicas are not ready in time.
    """
    ray = import_ray(_PURPOSE)
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
    actor_cls = _remote_class(ReplicaActor)
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
    return ReplicaSet(handles, name_prefix=name_prefix, namespace=namespace, placement_group=pg)


def find_replicas(
    name_prefix: str = "agentloop-server",
    *,
    namespace: str | None = None,
    timeout_s: float = 60.0,
    expected: int | None = None,
) -> ReplicaSet:
    """Handles of the named replicas ``f"{name_prefix}-0"``, ``-1``, ... (from any node).

    Args:
        name_prefix: The prefix given to :func:`start_replicas`.
        namespace: Their Ray namespace (None: this job's).
        timeout_s: How long to wait for them to be registered (a worker may start first).
        expected: Wait until this many are found (None: at least one, then take all with
            consecutive indices).

    Returns:
        The handles, in replica order, as a :class:`ReplicaSet` with the placement group named
        ``f"{name_prefix}-pg"`` if there is one.

    Raises:
        LookupError: when none (or fewer than ``expected``) appear within ``timeout_s``.
    """
    ray = import_ray(_PURPOSE)
    deadline = time.monotonic() + timeout_s
    while True:
        handles = []
        while True:
            try:
                handles.append(ray.get_actor(f"{name_prefix}-{len(handles)}", namespace=namespace))
            except ValueError:
                break
        if handles and (expected is None or len(handles) >= expected):
            return ReplicaSet(handles[:expected] if expected else handles, name_prefix=name_prefix,
                              namespace=namespace, placement_group=_named_group(ray, f"{name_prefix}-pg"))
        if time.monotonic() >= deadline:
            raise LookupError(
                f"found {len(handles)} replica(s) named {name_prefix!r}-<i> in namespace {namespace!r} "
                f"after {timeout_s}s (expected {expected or 'at least 1'}); start them with "
                "start_replicas(..., name_prefix=...) and join the same Ray namespace"
            )
        time.sleep(0.2)


def replica_nodes(handles: Sequence[Any], *, timeout_s: float = 60.0) -> list[str]:
    """The Ray node id of each replica, in order (from ``ReplicaActor.ready``)."""
    ray = import_ray(_PURPOSE)
    infos = ray.get([h.ready.remote() for h in handles], timeout=timeout_s)
    return [info["node_id"] for info in infos]


def stop_replicas(replicas: ReplicaSet | Sequence[Any] | str, *, namespace: str | None = None) -> int:
    """Kill replicas and release their placement group.

    Args:
        replicas: What to stop:

            * a :class:`ReplicaSet` (from :func:`start_replicas` or :func:`find_replicas`): its
              actors and its placement group;
            * a name prefix: the replicas ``f"{prefix}-<i>"`` and the group ``f"{prefix}-pg"``,
              found by name (so any driver can stop them, also after some replicas died);
            * a plain list of handles (e.g. a slice of a ReplicaSet): only those actors. A
              placement group reserved for them is NOT released, since a handle does not say
              which group it is in; stop the ReplicaSet or the prefix to release it.
        namespace: Ray namespace of named replicas (a name prefix only; a ReplicaSet carries its
            own).

    Returns:
        How many replicas were killed.
    """
    ray = import_ray(_PURPOSE)
    if isinstance(replicas, str):
        try:
            replicas = find_replicas(replicas, namespace=namespace, timeout_s=0)
        except LookupError:
            # No replica is left (all died, or all were stopped): the group may still be held.
            replicas = ReplicaSet(name_prefix=replicas, namespace=namespace,
                                  placement_group=_named_group(ray, f"{replicas}-pg"))
    for h in replicas:
        try:
            ray.kill(h)
        except Exception as exc:  # noqa: BLE001 - a replica lost with its node is already gone
            logger.debug("ray.kill of a replica failed: %s", exc)
    if isinstance(replicas, ReplicaSet) and replicas.placement_group is not None:
        remove_placement_group(replicas.placement_group)
    return len(replicas)


def _named_group(ray: Any, name: str) -> Any:
    try:
        return ray.util.get_placement_group(name)
    except ValueError:
        return None
