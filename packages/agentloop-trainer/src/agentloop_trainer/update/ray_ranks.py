"""FSDP ranks as Ray actors in a placement group, so one process group can span several nodes.

:func:`spawn_ray` is the Ray twin of :func:`agentloop_trainer.update.fsdp.spawn`: the same
``fn(rank, *args)`` runs on ``world_size`` actors (one per placement-group bundle, bundle index
= rank) that join one torch.distributed process group (gloo on CPU, NCCL on GPU), and rank 0's
result comes back. Rank 0's node address and a free port on that node are the rendezvous.

A rank that raises does not leave the others waiting in a collective forever: its error (rank,
node, pid and the original traceback text) reaches the caller as :class:`RankFailedError` and
every actor is killed. Placement (the resource check, the placement group and its readiness)
is the engines' hosting layer, so ranks and engine replicas fail with the same
:class:`~agentloop_engines.fleet.hosting.InsufficientResourcesError`. Ray is imported lazily;
``import agentloop_trainer`` never imports it.
"""

from __future__ import annotations

import os
import re
import time
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from agentloop_trainer.update.fsdp import LOOPBACK, free_port, init_process_group

__all__ = ["RankFailedError", "RayRankActor", "rendezvous_address", "spawn_ray"]

_ANSI = re.compile(r"\x1b\[[0-9;]*m")


class RankFailedError(RuntimeError):
    """A rank raised (or its actor died); the message holds the rank's own traceback text.

    Attributes:
        rank: The rank that failed first.
        error_type: Class name of the original exception (``"ActorDied"`` when the process died).
        remote_traceback: The traceback text formatted inside the rank's process.
    """

    def __init__(self, rank: int, world_size: int, error_type: str, message: str, remote_traceback: str,
                 where: str = "", others: str = "") -> None:
        self.rank = rank
        self.error_type = error_type
        self.remote_traceback = remote_traceback
        text = f"FSDP rank {rank} of {world_size} failed{where}: {error_type}: {message}"
        if others:
            text += f"\n(also failed afterwards: {others})"
        text += f"\n\n--- traceback from rank {rank} ---\n{remote_traceback.rstrip()}"
        super().__init__(text)


@dataclass(frozen=True)
class _Outcome:
    """What one rank's ``run`` hands back: its result or its error, never a raised exception."""

    rank: int
    """The rank that produced it."""
    ok: bool
    """False when ``fn`` (or joining the process group) raised."""
    result: Any = None
    """``fn``'s return value (``ok`` only)."""
    error_type: str = ""
    """Class name of the exception (failure only)."""
    message: str = ""
    """``str`` of the exception (failure only)."""
    traceback: str = ""
    """Traceback text formatted inside the rank (failure only)."""
    where: str = ""
    """Node address and pid of the rank, for the error message."""
    failed_at: float = 0.0
    """Wall-clock time of the failure, to tell the first failure from its knock-on effects."""


class RayRankActor:
    """Body of the Ray actor hosting one rank (wrapped with ``ray.remote`` by :func:`spawn_ray`).

    Args:
        rank: This actor's rank in the process group.
        world_size: Number of ranks.
    """

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank = rank
        self.world_size = world_size

    def node_address(self) -> str:
        """IP address of the node this rank runs on (rank 0's is the rendezvous address)."""
        import ray

        return ray.util.get_node_ip_address()

    def free_port(self, host: str) -> int:
        """A TCP port free on ``host`` (an address of this node), for the rendezvous store."""
        return free_port(host=host)

    def run(self, master_addr: str, master_port: int, device: str, fn: Callable[..., Any],
            args: tuple[Any, ...]) -> _Outcome:
        """Join the process group, run ``fn(rank, *args)``, leave the group.

        Errors are returned, not raised: the driver then knows which rank failed first and can
        stop the others, which may be blocked in a collective waiting for this one.
        """
        import ray

        where = f" on node {ray.util.get_node_ip_address()} (pid {os.getpid()})"
        joined = False
        try:
            init_process_group(self.rank, self.world_size, master_port, device, addr=master_addr)
            joined = True
            return _Outcome(self.rank, True, result=fn(self.rank, *args), where=where)
        except BaseException as exc:  # a rank's failure, whatever it is, must reach the driver
            return _Outcome(self.rank, False, error_type=type(exc).__name__, message=str(exc),
                            traceback=traceback.format_exc(), where=where, failed_at=time.time())
        finally:
            if joined:
                import torch.distributed as dist

                if dist.is_initialized():
                    dist.destroy_process_group()


def spawn_ray(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    device: str = "cpu",
    num_cpus_per_rank: float = 1.0,
    num_gpus_per_rank: float = 0.0,
    strategy: str = "PACK",
    placement_group: Any = None,
    timeout_s: float = 120.0,
    run_timeout_s: float | None = None,
    env_vars: Mapping[str, str] | None = None,
    rendezvous_addr: str | None = None,
) -> Any:
    """Run ``fn(rank, *args)`` on ``world_size`` Ray actors in one process group; rank 0's result.

    Each rank is an actor in its own placement-group bundle (bundle index = rank). The rendezvous
    (``MASTER_ADDR``/``MASTER_PORT``, an unauthenticated store hosted by rank 0) listens on
    127.0.0.1 when every rank runs on rank 0's node, else on rank 0's node IP only (never on every
    address of the node).

    Args:
        fn: Module-level function Ray workers can import (or unpickle by value).
        world_size: Number of ranks.
        *args: Passed to ``fn`` after the rank.
        device: ``"cpu"`` (gloo) or ``"cuda"`` (NCCL; needs ``num_gpus_per_rank > 0``).
        num_cpus_per_rank: CPUs each rank's bundle and actor reserve.
        num_gpus_per_rank: GPUs each rank's bundle and actor reserve.
        strategy: Placement strategy: PACK, SPREAD, STRICT_PACK or STRICT_SPREAD
            (:data:`~agentloop_engines.fleet.hosting.PLACEMENT_STRATEGIES`).
        placement_group: A placement group with at least ``world_size`` bundles, each holding
            one rank's resources; it is left alone afterwards. None: one is created here and
            removed at the end.
        timeout_s: How long the placement group and the actors may take to be ready.
        run_timeout_s: Limit for ``fn`` on all ranks (None: no limit).
        env_vars: Extra environment for the rank processes. ``OMP_NUM_THREADS`` is the
            caller's, or 1.
        rendezvous_addr: The address of rank 0's node the store listens on (one every rank can
            reach); None: chosen as above.

    Returns:
        What ``fn`` returned on rank 0.

    Raises:
        ImportError: without Ray.
        RuntimeError: when Ray is not initialised.
        ValueError: on a bad world size, device, strategy or placement group.
        InsufficientResourcesError: when the ranks cannot be placed (now, or within
            ``timeout_s``), or their actors do not start within ``timeout_s``.
        RankFailedError: when a rank raised or its actor died.
        TimeoutError: when ``run_timeout_s`` passed before every rank finished.
    """
    # Here, not at the top: the update room is imported by ``import agentloop_trainer``, which
    # stays free of the engines' hosting layer (and of numpy through agentloop_core).
    from agentloop_engines.fleet.hosting import (
        InsufficientResourcesError,
        bundle_for,
        check_strategy,
        import_ray,
        placement_group_for_ranks,
        rank_scheduling_strategy,
        remove_placement_group,
        wait_placement_group,
    )

    ray = import_ray("Running FSDP ranks on Ray", extra="agentloop-trainer[ray]")
    if world_size < 1:
        raise ValueError(f"spawn_ray needs world_size >= 1, got {world_size}")
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    if device == "cuda" and num_gpus_per_rank <= 0:
        raise ValueError("device='cuda' needs num_gpus_per_rank > 0: Ray hides GPUs from actors that reserve none")
    check_strategy(strategy)
    try:
        bundle_for(num_cpus_per_rank, num_gpus_per_rank)
    except ValueError as exc:
        raise ValueError(f"{exc} (spawn_ray: num_cpus_per_rank={num_cpus_per_rank}, "
                         f"num_gpus_per_rank={num_gpus_per_rank})") from exc
    if not ray.is_initialized():
        raise RuntimeError("Ray is not initialised: call ray.init(address=...) (or "
                           "agentloop_engines.fleet.hosting.connect_ray) before spawn_ray")
    if placement_group is not None and placement_group.bundle_count < world_size:
        raise ValueError(f"the placement group has {placement_group.bundle_count} bundles, "
                         f"{world_size} ranks need one each")

    env = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), **dict(env_vars or {})}
    own_pg = placement_group is None
    pg = placement_group
    actors: list[Any] = []
    try:
        if own_pg:
            pg = placement_group_for_ranks(world_size, num_cpus=num_cpus_per_rank, num_gpus=num_gpus_per_rank,
                                           strategy=strategy, timeout_s=timeout_s)
        else:
            wait_placement_group(pg, timeout_s=timeout_s, what=f"the placement group given to spawn_ray for "
                                 f"{world_size} FSDP rank(s)", fix="free what holds its resources, or build it from bundles the cluster can hold")
        actor_cls = ray.remote(RayRankActor)
        for rank in range(world_size):
            actors.append(actor_cls.options(
                num_cpus=num_cpus_per_rank, num_gpus=num_gpus_per_rank, max_restarts=0,
                scheduling_strategy=rank_scheduling_strategy(pg, rank),
                runtime_env={"env_vars": env},
            ).remote(rank, world_size))
        try:
            addresses = ray.get([a.node_address.remote() for a in actors], timeout=timeout_s)
            master_addr = rendezvous_addr or rendezvous_address(addresses)
            port = ray.get(actors[0].free_port.remote(master_addr), timeout=timeout_s)
        except ray.exceptions.GetTimeoutError as exc:
            raise InsufficientResourcesError(
                f"{world_size} rank actors did not start within {timeout_s:g}s although their placement "
                "group is ready; check the Ray worker logs (slow imports, runtime_env setup)"
            ) from exc
        refs = [a.run.remote(master_addr, port, device, fn, args) for a in actors]
        return _collect(ray, refs, world_size, run_timeout_s)
    finally:
        for actor in actors:
            # Killing is what unblocks ranks stuck in a collective after a peer failed.
            ray.kill(actor, no_restart=True)
        if own_pg and pg is not None:
            remove_placement_group(pg)


def rendezvous_address(node_addresses: list[str]) -> str:
    """Where the ranks meet, given each rank's node IP (rank 0's first): 127.0.0.1 when they are
    all on rank 0's node (nothing beyond loopback can reach the store), else rank 0's node IP."""
    return LOOPBACK if all(a == node_addresses[0] for a in node_addresses) else node_addresses[0]


FAILURE_GRACE_S = 3.0
"""How long, once a rank has failed, the driver waits for the other ranks' outcomes before it
picks the earliest failure (the root cause rather than a peer's knock-on error)."""


def _collect(ray: Any, refs: list[Any], world_size: int, run_timeout_s: float | None) -> Any:
    """Wait for every rank; on the first failure raise it (the caller's finally kills the rest)."""
    rank_of = {ref: rank for rank, ref in enumerate(refs)}
    deadline = None if run_timeout_s is None else time.monotonic() + run_timeout_s
    pending = list(refs)
    results: dict[int, Any] = {}
    while pending:
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        ready, pending = ray.wait(pending, num_returns=1, timeout=left)
        if not ready:
            raise TimeoutError(f"FSDP ranks {sorted(rank_of[r] for r in pending)} still running after "
                               f"run_timeout_s={run_timeout_s:g}s; stopped them")
        # Take everything already done too, so the earliest failure wins over its knock-on errors.
        more, pending = ray.wait(pending, num_returns=len(pending), timeout=0) if pending else ([], [])
        failures = []
        for ref in ready + more:
            outcome = _outcome(ray, ref, rank_of[ref])
            if outcome.ok:
                results[outcome.rank] = outcome.result
            else:
                failures.append(outcome)
        if failures and pending:
            # A failing rank's peers fail too (a collective loses its partner), and a peer's
            # knock-on error can reach the driver before the root cause does: give the other
            # ranks a moment to report, then blame the earliest failure.
            late, pending = ray.wait(pending, num_returns=len(pending), timeout=FAILURE_GRACE_S)
            failures += [o for o in (_outcome(ray, ref, rank_of[ref]) for ref in late) if not o.ok]
        if failures:
            failures.sort(key=lambda o: o.failed_at)
            first = failures[0]
            others = ", ".join(f"rank {o.rank}: {o.error_type}" for o in failures[1:])
            raise RankFailedError(first.rank, world_size, first.error_type, first.message, first.traceback,
                                  first.where, others)
    return results[0]


def _outcome(ray: Any, ref: Any, rank: int) -> _Outcome:
    try:
        return ray.get(ref)
    except ray.exceptions.RayError as exc:
        # The process died (OOM, segfault, node lost) or the task's arguments could not be
        # unpickled there (fn not importable on the workers).
        cause = getattr(exc, "cause", None)
        text = _ANSI.sub("", str(exc))
        kind = type(cause).__name__ if isinstance(cause, BaseException) else type(exc).__name__
        last = [line for line in text.splitlines() if line.strip()]
        return _Outcome(rank, False, error_type=kind, message=last[-1] if last else "", traceback=text,
                        failed_at=time.time())
