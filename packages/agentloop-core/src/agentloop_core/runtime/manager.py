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
from agentloop_core.runtime.config import plain, resolve_agent_names
from agentloop_core.runtime.worker import AgentLoopWorker, import_loop_modules
from agentloop_core.tracing import Tracer, make_tracer

logger = logging.getLogger(__name__)

BACKENDS = ("inprocess", "ray")
_RAY_HINT = 'the "ray" rollout backend needs Ray: pip install "agentloop-core[ray]"'


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
    or a tracing config. Both backends return the same results for a deterministic engine.

    Args:
        server: The engine or engines client.
        tokenizer: A tokenizer or its path (loaded lazily with ``AutoTokenizer``).
        config: Rollout config: the :class:`AgentLoopWorker` keys plus ``prompt_length``,
            ``response_length``, ``pad_token_id`` and ``truncate`` for padding.
        num_workers: How many workers (chunks) a batch is split over.
        backend: ``"inprocess"`` or ``"ray"`` (Ray must be initialised by the caller).
        tracer: A tracer or tracing config (see :func:`~agentloop_core.tracing.make_tracer`).
        processor: A multimodal processor, when the model has one.
        ray_num_cpus: CPUs each Ray actor reserves; keep it fractional, since an actor whose
            request cannot be met stays pending forever.
        ray_timeout_s: Limit on actor start-up and on one batch through Ray.

    Raises:
        ValueError: an unknown backend or a bad ``num_workers``.
        ImportError: ``backend="ray"`` without Ray installed.
    """

    def __init__(
        self,
        server: AsyncServer,
        tokenizer: Any,
        config: Mapping[str, Any] | None = None,
        *,
        num_workers: int = 1,
        backend: str = "inprocess",
        tracer: Tracer | Mapping[str, Any] | None = None,
        processor: Any = None,
        ray_num_cpus: float = 0.1,
        ray_timeout_s: float = 3600.0,
    ) -> None:
        if backend not in BACKENDS:
            raise ValueError(f"unknown rollout backend {backend!r}; valid backends: {', '.join(BACKENDS)}")
        if not isinstance(num_workers, int) or num_workers < 1:
            raise ValueError(f"num_workers must be a positive integer, got {num_workers!r}")
        self.server = server
        self.tokenizer = tokenizer
        self.config: dict[str, Any] = plain(config or {})
        self.num_workers = num_workers
        self.backend = backend
        self.processor = processor
        self.ray_num_cpus = ray_num_cpus
        self.ray_timeout_s = ray_timeout_s
        import_loop_modules(self.config.get("agent_loop_modules") or ())
        self._tracer_spec = tracer
        self._workers: list[AgentLoopWorker] = []
        self._actors: list[Any] = []
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
        try:
            import ray
        except ImportError as exc:
            raise ImportError(_RAY_HINT) from exc
        if not ray.is_initialized():
            raise RuntimeError(
                "the ray rollout backend needs a running Ray: call ray.init(...) before creating "
                "AgentLoopManager(backend='ray')"
            )
        from agentloop_core.runtime.ray_worker import RayAgentLoopWorker

        actor_cls = ray.remote(RayAgentLoopWorker).options(num_cpus=self.ray_num_cpus)
        tracer = self._tracer_spec
        self._actors = [
            actor_cls.remote(self.server, self.tokenizer, self.config, tracer, self.processor)
            for _ in range(self.num_workers)
        ]
        try:
            ray.get([a.ready.remote() for a in self._actors], timeout=self.ray_timeout_s)
        except ray.exceptions.GetTimeoutError as exc:
            self.shutdown()
            raise TimeoutError(
                f"{self.num_workers} rollout actor(s) did not start within ray_timeout_s="
                f"{self.ray_timeout_s}; an actor waits forever when its CPU request cannot be met, "
                f"so lower ray_num_cpus (now {self.ray_num_cpus}) or give Ray more CPUs"
            ) from exc

    def shutdown(self) -> None:
        """Stop the Ray actors and close the private event loop of the sync API."""
        if self._actors:
            import ray

            for actor in self._actors:
                ray.kill(actor)
            self._actors = []
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
        """Roll out ``rows`` over the workers; one output per row, in input order (failed
        samples included, flagged in ``metrics``).

        Raises:
            ValueError / UnknownAgentLoopError: a row names no loop, or an unknown one; raised
                before any sample starts.
            TimeoutError: a Ray batch ran past ``ray_timeout_s``.
        """
        rows = [dict(r) if isinstance(r, Mapping) else r for r in rows]
        names = resolve_agent_names(rows, self.config.get("default_agent_loop"))
        modules = sorted({get_agent_loop_class(n).__module__ for n in set(names)})
        chunks = split_evenly(len(rows), self.num_workers)
        if self.backend == "inprocess":
            parts = await asyncio.gather(
                *(
                    self._workers[k].generate_sequences(
                        rows[a:b], validate=validate, step=step, sample_offset=a
                    )
                    for k, (a, b) in enumerate(chunks)
                )
            )
        else:
            refs = [
                self._actors[k].generate_sequences.remote(rows[a:b], validate, step, a, modules)
                for k, (a, b) in enumerate(chunks)
            ]
            try:
                parts = await asyncio.wait_for(asyncio.gather(*refs), self.ray_timeout_s)
            except asyncio.TimeoutError as exc:
                import ray

                for ref in refs:  # do not leave orphaned rollouts running in the actors
                    ray.cancel(ref)
                raise TimeoutError(
                    f"rollout batch of {len(rows)} samples did not finish within ray_timeout_s={self.ray_timeout_s}"
                ) from exc
        return [out for part in parts for out in part]

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
            The padded batch; ``metrics`` holds ``rollout/num_failed`` and timings.
        """
        start = time.perf_counter()
        outputs = await self.agenerate_outputs(rows, validate=validate, step=step)
        batch = RolloutBatch.from_outputs(
            outputs,
            prompt_length=self.config.get("prompt_length"),
            response_length=self.config.get("response_length"),
            pad_token_id=self.config.get("pad_token_id"),
            tokenizer=self._tokenizer_for_padding(),
            truncate=bool(self.config.get("truncate", False)),
        )
        batch.metrics["timing_s/generate_sequences"] = time.perf_counter() - start
        batch.metrics["rollout/num_workers"] = float(self.num_workers)
        if batch.num_failed:
            first = next(m.get("error") for m in batch.sample_metrics if m.get("failed"))
            logger.warning(
                "%d of %d rollout samples failed; first error: %s", batch.num_failed, len(batch), first
            )
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
        if self.config.get("pad_token_id") is not None:
            return None
        if self._workers:
            return self._workers[0].tokenizer
        if isinstance(self.tokenizer, (str, os.PathLike)):
            from transformers import AutoTokenizer

            self.tokenizer = AutoTokenizer.from_pretrained(os.fspath(self.tokenizer))
        return self.tokenizer
