"""The rollout manager: splits a batch over rollout workers and pads the result."""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Mapping, Sequence
from typing import Any

from agentloop_core.batch import RolloutBatch
from agentloop_core.output import AgentLoopOutput
from agentloop_core.protocol import AsyncServer
from agentloop_core.registry import get_agent_loop_class
from agentloop_core.runtime.config import resolve_agent_names
from agentloop_core.runtime.ray_pool import PLACEMENTS, ChunkStats, RayWorkerPool
from agentloop_core.runtime.worker import AgentLoopWorker
from agentloop_core.settings import RolloutConfig
from agentloop_core.tracing import Tracer, make_tracer

logger = logging.getLogger(__name__)

BACKENDS = ("inprocess", "ray")


def split_evenly(n: int, parts: int) -> list[tuple[int, int]]:
    """Contiguous ``(start, stop)`` ranges covering ``range(n)``, sizes differing by at most
    one; empty ranges are dropped."""
    base, extra = divmod(n, parts)
    ranges, start = [], 0
    for k in range(parts):
        stop = start + base + (1 if k < extra else 0)
        if stop > start:
            ranges.append((start, stop))
        start = stop
    return ranges


class AgentLoopManager:
    """Splits rollout batches over ``num_workers`` :class:`AgentLoopWorker` s and pads the
    outputs into a :class:`~agentloop_core.batch.RolloutBatch`.

    With ``backend="inprocess"`` the workers share this process's event loop. With
    ``backend="ray"`` each worker is an async Ray actor; then ``server``, ``tokenizer``,
    ``config`` and ``tracer`` are pickled to every actor, so the server must pickle (a
    :class:`~agentloop_core.testing.ScriptedServer`, or an engines client holding Ray actor
    handles, never a client bound to this process's event loop), the tokenizer is best given
    as a path, and a tracer must be one that writes somewhere shared (JSONL file, MLflow store)
    or a tracing config. Both backends return the same results for a deterministic engine,
    and for a sampling one when the config sets ``sampling_seed``.

    On a multi-node cluster, ``placement="spread"`` puts the workers round-robin on the alive
    nodes (soft affinity). A worker that dies mid-batch (its node lost) has its chunk re-run
    once on a surviving worker; samples that cannot be re-run come back failed with the reason,
    never missing. Dead workers leave the rotation; see :mod:`agentloop_core.runtime.ray_pool`.

    Args:
        server: The engine or engines client.
        tokenizer: A tokenizer or its path (loaded lazily with ``AutoTokenizer``).
        config: The rollout's :class:`~agentloop_core.settings.RolloutConfig` (its
            ``prompt_length``, ``response_length``, ``pad_token_id`` and ``truncate`` pad the
            batch); a mapping from a script of its own is converted with
            ``RolloutConfig.from_mapping`` here, the only place core reads a rollout dict.
        num_workers: How many workers (chunks) a batch is split over.
        backend: ``"inprocess"`` or ``"ray"`` (Ray must be initialised by the caller).
        tracer: A tracer or tracing config (see :func:`~agentloop_core.tracing.make_tracer`).
        processor: A multimodal processor, when the model has one.
        ray_num_cpus: CPUs each Ray actor reserves; keep it fractional, since an actor whose
            request cannot be met stays pending forever.
        ray_timeout_s: Limit on actor start-up and on one batch through Ray.
        placement: Ray backend only: ``"spread"`` (round-robin over the alive nodes, with
            soft node affinity so a worker still starts when its node is full) or
            ``"default"`` (Ray's choice).

    Raises:
        ValueError: an unknown backend or placement, or a bad ``num_workers``.
        ImportError: ``backend="ray"`` without Ray installed.
    """

    def __init__(
        self,
        server: AsyncServer,
        tokenizer: Any,
        config: RolloutConfig | Mapping[str, Any] | None = None,
        *,
        num_workers: int = 1,
        backend: str = "inprocess",
        tracer: Tracer | Mapping[str, Any] | None = None,
        processor: Any = None,
        ray_num_cpus: float = 0.1,
        ray_timeout_s: float = 3600.0,
        placement: str = "spread",
    ) -> None:
        if backend not in BACKENDS:
            raise ValueError(f"unknown rollout backend {backend!r}; valid backends: {', '.join(BACKENDS)}")
        if placement not in PLACEMENTS:
            raise ValueError(f"unknown worker placement {placement!r}; valid: {', '.join(PLACEMENTS)}")
        if not isinstance(num_workers, int) or num_workers < 1:
            raise ValueError(f"num_workers must be a positive integer, got {num_workers!r}")
        self.server = server
        self.tokenizer = tokenizer
        self.config = RolloutConfig.of(config)
        self.num_workers = num_workers
        self.backend = backend
        self.processor = processor
        self.ray_num_cpus = ray_num_cpus
        self.ray_timeout_s = ray_timeout_s
        self.placement = placement
        self.config.register_loops()
        self._tracer_spec = tracer
        self._workers: list[AgentLoopWorker] = []
        self._pool: RayWorkerPool | None = None
        self._sync_loop: asyncio.AbstractEventLoop | None = None
        if backend == "inprocess":
            shared = make_tracer(tracer)
            self._workers = [
                AgentLoopWorker(server, tokenizer, self.config, tracer=shared, processor=processor)
                for _ in range(num_workers)
            ]
        else:
            self._start_actors()

    # -- Ray -----------------------------------------------------------------------------------

    def _start_actors(self) -> None:
        self._pool = RayWorkerPool(
            (self.server, self.tokenizer, self.config, self._tracer_spec, self.processor),
            self.num_workers,
            num_cpus=self.ray_num_cpus,
            timeout_s=self.ray_timeout_s,
            placement=self.placement,
        )

    def worker_node_ids(self) -> list[str | None]:
        """The Ray node id of each rollout worker still in the rotation (None for each
        in-process worker)."""
        if self._pool is None:
            return [None] * len(self._workers)
        return self._pool.node_ids()

    def shutdown(self) -> None:
        """Stop the Ray actors and close the private event loop of the sync API."""
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None
        for worker in self._workers:
            worker.tracer.close()
        if self._sync_loop is not None and not self._sync_loop.is_closed():
            self._sync_loop.close()
        self._sync_loop = None

    def __enter__(self) -> AgentLoopManager:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    # -- rollout -------------------------------------------------------------------------------

    async def agenerate_outputs(
        self, rows: Sequence[Mapping[str, Any]], validate: bool = False, step: int | None = None
    ) -> list[AgentLoopOutput]:
        """Roll out ``rows`` over the workers; rows in input order, each as one output or,
        when its loop split the trajectory, as its segments (``trajectory_index`` is the
        row's index, ``segment_index`` the segment's). Failed samples are one output each,
        flagged in ``metrics``.

        Raises:
            ValueError / UnknownAgentLoopError: a row names no loop, or an unknown one; raised
                before any sample starts.
            TimeoutError: a Ray batch ran past ``ray_timeout_s``.
        """
        outputs, _ = await self._agenerate(rows, validate, step)
        return outputs

    async def _agenerate(
        self, rows: Sequence[Mapping[str, Any]], validate: bool, step: int | None
    ) -> tuple[list[AgentLoopOutput], ChunkStats]:
        rows = [dict(r) if isinstance(r, Mapping) else r for r in rows]
        names = resolve_agent_names(rows, self.config.default_agent_loop)
        modules = sorted({get_agent_loop_class(n).__module__ for n in set(names)})
        if self.backend == "ray" and self._pool is None:
            raise RuntimeError("this AgentLoopManager was shut down; create a new one")
        if self._pool is None:
            chunks = split_evenly(len(rows), self.num_workers)
            parts = await asyncio.gather(
                *(
                    self._workers[k].generate_sequences(
                        rows[a:b], validate=validate, step=step, sample_offset=a
                    )
                    for k, (a, b) in enumerate(chunks)
                )
            )
            return [out for part in parts for out in part], ChunkStats()
        if not self._pool.alive:
            reason = (f"all {self._pool.started} rollout workers died in earlier batches; restart the "
                      "AgentLoopManager (or the run) once the cluster has nodes again")
            stats = ChunkStats(num_lost=len(rows))
            return [AgentLoopOutput.failure(None, reason, trajectory_index=i, sample_index=i, agent_name=n,
                                            worker_failure=True)
                    for i, n in enumerate(names)], stats
        chunks = split_evenly(len(rows), self._pool.alive)
        return await self._pool.run(rows, chunks, (validate, step, modules), names, self.ray_timeout_s)

    async def agenerate_sequences(
        self, rows: Sequence[Mapping[str, Any]], validate: bool = False, step: int | None = None
    ) -> RolloutBatch:
        """Roll out ``rows`` and pad them into a :class:`RolloutBatch` (async entry point).

        Args:
            rows: Dataset rows; each names its loop by ``agent_name`` (or uses
                ``default_agent_loop``).
            validate: Use ``val_sampling_params``.
            step: Training step, for trace tags.

        Returns:
            The padded batch, one row per segment (``trajectory_index`` maps a row back to
            ``rows``); ``metrics`` holds ``rollout/num_failed``, timings and, with the
            Ray backend, ``rollout/worker_failures`` (workers that died during the batch),
            ``rollout/num_retried`` (samples re-run on a survivor) and
            ``rollout/num_lost_to_worker_failures`` (samples returned failed because of it).
        """
        start = time.perf_counter()
        outputs, stats = await self._agenerate(rows, validate, step)
        batch = RolloutBatch.from_outputs(
            outputs,
            prompt_length=self.config.prompt_length,
            response_length=self.config.response_length,
            pad_token_id=self.config.pad_token_id,
            tokenizer=self._tokenizer_for_padding(),
            truncate=self.config.truncate,
        )
        batch.metrics["timing_s/generate_sequences"] = time.perf_counter() - start
        batch.metrics["rollout/num_workers"] = float(self._pool.alive if self._pool else self.num_workers)
        if self._pool is not None:
            batch.metrics["rollout/worker_failures"] = float(stats.worker_failures)
            batch.metrics["rollout/num_retried"] = float(stats.num_retried)
            batch.metrics["rollout/num_lost_to_worker_failures"] = float(stats.num_lost)
        if batch.num_failed:
            first = next(m.get("error") for m in batch.sample_metrics if m.get("failed"))
            logger.warning(
                "%d of %d rollout samples failed; first error: %s",
                batch.num_failed, batch.num_trajectories, first,
            )  # fmt: skip
        return batch

    def generate_sequences(
        self, rows: Sequence[Mapping[str, Any]], validate: bool = False, step: int | None = None
    ) -> RolloutBatch:
        """Synchronous :meth:`agenerate_sequences`, on a private event loop kept across calls
        (so an in-process server's asyncio state stays on one loop).

        Raises:
            RuntimeError: when called from a running event loop; await
                :meth:`agenerate_sequences` there instead.
        """
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            pass
        else:
            raise RuntimeError(
                "AgentLoopManager.generate_sequences was called inside a running event loop; "
                "use `await manager.agenerate_sequences(...)` there"
            )
        if self._sync_loop is None or self._sync_loop.is_closed():
            self._sync_loop = asyncio.new_event_loop()
        return self._sync_loop.run_until_complete(
            self.agenerate_sequences(rows, validate=validate, step=step)
        )

    def _tokenizer_for_padding(self) -> Any:
        if self.config.pad_token_id is not None:
            return None
        if self._workers:
            return self._workers[0].tokenizer
        if isinstance(self.tokenizer, (str, os.PathLike)):
            from transformers import AutoTokenizer

            self.tokenizer = AutoTokenizer.from_pretrained(os.fspath(self.tokenizer))
        return self.tokenizer
