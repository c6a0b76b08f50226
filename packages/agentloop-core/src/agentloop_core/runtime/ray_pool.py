"""The Ray side of :class:`~agentloop_core.runtime.AgentLoopManager`: rollout worker actors
placed over the cluster's nodes, and batches that survive a worker (or its node) dying.

Placement ``"spread"`` pins worker ``k`` to the ``k % n``-th alive node (sorted by node id)
with *soft* node affinity that may spill: the worker still starts elsewhere when its node is
full or gone.

When a worker dies mid-batch its chunk is re-run once on a surviving worker; if that fails
too, or no worker is left, the chunk's samples come back as failed outputs naming the dead
worker and its node. Dead workers leave the rotation for good (later batches are split over
the survivors); the counts land in the batch metrics ``rollout/worker_failures`` and
``rollout/num_retried``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from agentloop_core.output import AgentLoopOutput

logger = logging.getLogger(__name__)

PLACEMENTS = ("spread", "default")
_RAY_HINT = 'the "ray" rollout backend needs Ray: pip install "agentloop-core[ray]"'
# What Ray raises when an actor, its worker process, its node or the object holding its result
# is gone. Anything else (an exception from our own code) is a bug to surface, not to retry.
_DEATH_ERRORS = ("RayActorError", "NodeDiedError", "WorkerCrashedError", "ObjectLostError")


@dataclass
class RayWorker:
    """One rollout worker actor and where it runs."""

    index: int
    """Its position when the pool started (stable across deaths, for messages)."""
    actor: Any
    """The Ray actor handle."""
    pid: int | None = None
    """Its process id (from ``ready``)."""
    node_id: str | None = None
    """The Ray node it runs on (from ``ready``)."""

    def describe(self) -> str:
        node = self.node_id[:12] if self.node_id else "?"
        return f"rollout worker {self.index} (actor {self.actor._actor_id.hex()[:12]}, node {node}, pid {self.pid})"


@dataclass
class ChunkStats:
    """What happened to worker actors during one batch."""

    worker_failures: int = 0
    """Workers found dead during the batch."""
    num_retried: int = 0
    """Samples re-run on another worker after theirs died."""
    num_lost: int = 0
    """Samples returned as failed because no surviving worker could run them."""
    events: list[str] = field(default_factory=list)
    """One line per failure, for logs and tests."""


def death_errors() -> tuple[type[BaseException], ...]:
    """The Ray exception types that mean the worker is gone (not that its code raised)."""
    import ray.exceptions  # the submodule by name: ``import ray`` binds it only as a side effect

    return tuple(t for n in _DEATH_ERRORS if (t := getattr(ray.exceptions, n, None)) is not None)


class RayWorkerPool:
    """Starts ``num_workers`` rollout worker actors and runs chunks on them.

    Args:
        actor_args: Constructor arguments of ``RayAgentLoopWorker`` (server, tokenizer,
            config, tracer, processor).
        num_workers: How many actors.
        num_cpus: CPUs each reserves (fractional: an unmeetable request pends forever).
        timeout_s: Limit on start-up.
        placement: ``"spread"`` (round-robin over alive nodes, soft affinity) or ``"default"``
            (Ray's choice).

    Raises:
        ImportError: without Ray.
        RuntimeError: when Ray is not initialised.
        TimeoutError: when the actors do not start in time.
    """

    def __init__(
        self, actor_args: Sequence[Any], num_workers: int, *, num_cpus: float, timeout_s: float, placement: str
    ) -> None:
        try:
            import ray
            import ray.exceptions
        except ImportError as exc:
            raise ImportError(_RAY_HINT) from exc
        if not ray.is_initialized():
            raise RuntimeError(
                "the ray rollout backend needs a running Ray: call ray.init(...) (or "
                "agentloop_engines.fleet.hosting.connect_ray) before creating AgentLoopManager(backend='ray')"
            )
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        from agentloop_core.runtime.ray_worker import RayAgentLoopWorker

        actor_cls = ray.remote(RayAgentLoopWorker)
        nodes = sorted(n["NodeID"] for n in ray.nodes() if n.get("Alive")) if placement == "spread" else []
        self.workers: list[RayWorker] = []
        for k in range(num_workers):
            options: dict[str, Any] = {"num_cpus": num_cpus}
            if nodes:
                # soft alone still queues on a node that is alive but full; spilling lets the
                # worker start elsewhere then (a private flag of Ray >= 2.x, stable since 2.3).
                options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(
                    nodes[k % len(nodes)], soft=True, _spill_on_unavailable=True
                )
            self.workers.append(RayWorker(k, actor_cls.options(**options).remote(*actor_args)))
        try:
            infos = ray.get([w.actor.ready.remote() for w in self.workers], timeout=timeout_s)
        except ray.exceptions.GetTimeoutError as exc:
            self.shutdown()
            raise TimeoutError(
                f"{num_workers} rollout actor(s) did not start within ray_timeout_s={timeout_s}; an "
                f"actor waits forever when its CPU request cannot be met, so lower ray_num_cpus (now "
                f"{num_cpus}) or give Ray more CPUs"
            ) from exc
        for worker, info in zip(self.workers, infos, strict=True):
            worker.pid, worker.node_id = info["pid"], info["node_id"]
        self.started = num_workers

    @property
    def alive(self) -> int:
        """Workers still in the rotation."""
        return len(self.workers)

    def node_ids(self) -> list[str | None]:
        """The node id of each worker in the rotation."""
        return [w.node_id for w in self.workers]

    def shutdown(self) -> None:
        """Kill every worker actor."""
        import ray

        for worker in self.workers:
            try:
                ray.kill(worker.actor)
            except Exception as exc:  # noqa: BLE001 - an actor lost with its node is gone already
                logger.debug("ray.kill of %s failed: %s", worker.describe(), exc)
        self.workers = []

    async def run(
        self,
        rows: Sequence[Mapping[str, Any]],
        chunks: Sequence[tuple[int, int]],
        call_args: tuple[Any, ...],
        names: Sequence[str],
        timeout_s: float,
    ) -> tuple[list[AgentLoopOutput], ChunkStats]:
        """Run chunk ``k`` on worker ``k``; re-run a dead worker's chunk once elsewhere.
        Returns every chunk's outputs (a sample's segments, or its one failed output) in order.

        Args:
            rows: The batch.
            chunks: ``(start, stop)`` ranges, at most one per worker in the rotation.
            call_args: ``(validate, step)`` then ``loop_modules``, as the actor takes them.
            names: The agent loop name of each row, for failed outputs.
            timeout_s: Limit on the whole batch.

        Raises:
            TimeoutError: the batch ran past ``timeout_s``. Then, and when the caller cancels
                this call, the chunks still running are cancelled in the actors.
        """
        import ray

        stats = ChunkStats()
        validate, step, modules = call_args
        workers = list(self.workers)
        errors = death_errors()

        async def call(worker: RayWorker, a: int, b: int) -> list[AgentLoopOutput]:
            ref = worker.actor.generate_sequences.remote(list(rows[a:b]), validate, step, a, modules)
            try:
                return await ref
            except asyncio.CancelledError:
                # The batch timed out or its caller cancelled it (the asynchronous trainer
                # stopping a group): no chunk may keep rolling out in its actor unrecorded. Ray
                # cancels recursively, so the chunk's loops and the engine calls they await stop.
                ray.cancel(ref)
                raise

        def lost(a: int, b: int, reason: str) -> list[AgentLoopOutput]:
            stats.num_lost += b - a
            return [
                AgentLoopOutput.failure(None, reason, trajectory_index=i, sample_index=i, agent_name=names[i],
                                        worker_failure=True)
                for i in range(a, b)
            ]

        async def one(k: int, a: int, b: int) -> list[AgentLoopOutput]:
            worker = workers[k]
            try:
                return await call(worker, a, b)
            except errors as exc:
                first = self._drop(worker, exc, stats)
            survivors = [w for w in self.workers if w is not worker]
            if not survivors:
                return lost(a, b, f"{first}; no rollout worker is left to re-run samples {a}..{b - 1}")
            other = survivors[k % len(survivors)]
            stats.num_retried += b - a
            logger.warning("%s; re-running its %d samples on %s", first, b - a, other.describe())
            try:
                outs = await call(other, a, b)
            except errors as exc:
                second = self._drop(other, exc, stats)
                return lost(a, b, f"{first}; the re-run failed too: {second}")
            for out in outs:
                out.metrics["rerun_after"] = first
            return outs

        gathered = asyncio.gather(*(one(k, a, b) for k, (a, b) in enumerate(chunks)))
        try:
            parts = await asyncio.wait_for(gathered, timeout_s)
        except asyncio.TimeoutError as exc:
            raise TimeoutError(
                f"rollout batch of {len(rows)} samples did not finish within ray_timeout_s={timeout_s}"
            ) from exc
        finally:
            # When this call is cancelled, the gather can end holding a CancelledError that
            # nobody reads (asyncio then logs "exception was never retrieved"): read it.
            if gathered.done() and not gathered.cancelled():
                gathered.exception()
        return [out for part in parts for out in part], stats

    def _drop(self, worker: RayWorker, exc: BaseException, stats: ChunkStats) -> str:
        """Take a dead worker out of the rotation (once) and describe what happened."""
        detail = (str(exc).strip().splitlines() or [""])[0][:300]
        what = f"{worker.describe()} died: {type(exc).__name__}: {detail}"
        if worker in self.workers:
            self.workers.remove(worker)
            stats.worker_failures += 1
            stats.events.append(what)
            logger.warning("%s; dropped from the rotation (%d of %d workers left)", what, len(self.workers), self.started)
            try:
                import ray

                # ActorUnavailableError may be transient: make sure it does not keep working.
                ray.kill(worker.actor)
            except Exception as kill_exc:  # noqa: BLE001 - it is gone already
                logger.debug("ray.kill of dead %s: %s", worker.describe(), kill_exc)
        return what
