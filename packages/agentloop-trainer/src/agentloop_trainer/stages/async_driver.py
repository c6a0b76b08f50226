"""The asynchronous GRPO step (``trainer.mode=one_step_off|async``).

A producer task on the trainer's event loop keeps starting whole GRPO groups (one record's
``n`` samples) while :class:`~agentloop_trainer.stages.async_buffer.StalenessBuffer` admits them, and
files each group there when all its samples have ended. A training step takes a batch of
groups from the buffer, runs the update in a thread (so the event loop, hence the engine and
the loops, keep rolling out meanwhile), and pushes the new weights through the engine's
:class:`~agentloop_core.partial_rollout.PartialRolloutServer`: in ``async`` mode in-flight
generations are interrupted and resume on the new weights; in ``one_step_off`` they finish on
the old ones first.

The driver reaches the wrapper only through the engine's
:class:`~agentloop_core.partial_rollout.RolloutControl` (``RolloutFleet.control``), so one code
path serves a wrapper in this process and one inside the shared Ray client actor (where all
rollout workers' calls pass). It is the wrapper's only controller, so it keeps its own copy of
the policy version and of whether a push is under way instead of asking for them.

A group judge (``reward.judge.mode=group``) scores each group as soon as its last sample ends,
before it enters the buffer (the groups of a step finish at different times, each judged on its
own). With dynamic sampling or over-long shaping on (:mod:`agentloop_trainer.rollout.dynamic_sampling`),
a finished group is shaped and judged before it enters the buffer; a dropped group is discarded
from it at once, so its room goes to a new group and no staleness is counted for it.

The importance correction needs nothing extra: a resumed generation's log-probs are each
token's own engine log-prob, so ``rollout_log_probs`` (and ``actor.tis_cap``) already compare
the trained policy with the policy that sampled each token.

``--resume`` trains the prompts the uninterrupted run would have, started in the same order. A
checkpoint records, besides the data iterator's position (the producer's, ahead of training),
every group started but not yet trained (:meth:`AsyncDriver.state`: its index, the version it
started under and its row of the training data) and the rows drawn from the data iterator but
not yet started. The resumed run rolls those groups out first, under their old indices (same
request ids, hence the same sampling seeds) and start versions (same deadlines: a group the
uninterrupted run had to train at the next step is trained there), then the leftover rows, then
continues from the saved data position. Which groups a step trains otherwise depends on which
finish first, in either run. What is lost: the groups' generations themselves. A group's partial
or finished rollout is not saved; the resumed run samples it again from scratch on the restored
weights, so its tokens, rewards and losses differ from the uninterrupted run's (its tokens are
fresher: the staleness metrics still count from the version the group first started under).
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from typing import TYPE_CHECKING, Any

from agentloop_trainer.rollout.dynamic_sampling import join_groups
from agentloop_trainer.rollout.rollouts import make_rows
from agentloop_trainer.stages.async_buffer import Group, StalenessBuffer, staleness_metrics

if TYPE_CHECKING:
    from agentloop_core.partial_rollout import RolloutControl

__all__ = ["AsyncDriver"]


class AsyncDriver:
    """Runs the steps of one asynchronous GRPO run for a :class:`~agentloop_trainer.stages.grpo.PolicyGradientTrainer`.

    Args:
        trainer: The trainer on rank 0, the one that hosts the engine (under FSDP the other
            ranks follow its steps: :meth:`train_step`).
    """

    def __init__(self, trainer: Any) -> None:
        from agentloop_core.partial_rollout import RolloutControl
        from agentloop_trainer.config.accessors import max_staleness

        self.trainer = trainer
        self.fleet = trainer.fleet
        control = getattr(self.fleet, "control", None)
        if not isinstance(control, RolloutControl):
            raise TypeError("the asynchronous trainer needs the RolloutFleet built with trainer.mode set (its "
                            "engine behind a PartialRolloutServer, reached through RolloutFleet.control)")
        self.control: RolloutControl = control
        self._policy_version = 0  # the wrapper's, as last set by this driver
        self._pushing = False  # a weight push holds the wrapper's gate closed
        self.max_staleness = max_staleness(trainer.cfg)
        self.buffer = StalenessBuffer(trainer.cfg.data.train_batch_size, self.max_staleness)
        self.base_step = 0  # versions are counted from the step this driver started at
        self._records: list[int] = []  # rows drawn from the data iterator, not yet started
        self._group_records: dict[int, int] = {}  # open group index -> its row of the training data
        self._replay: list[Group] = []  # groups reopened from a checkpoint, to roll out first
        self.trained_groups: dict[int, list[tuple[int, int]]] = {}
        """Per trained step: ``(group index, training-data row)`` of each group it trained (what
        the resume tests compare with the uninterrupted run)."""
        self._tasks: set[asyncio.Task] = set()
        self._producer: asyncio.Task | None = None
        self._changed: asyncio.Event | None = None
        self._error: BaseException | None = None
        # Since the last take: groups that entered the buffer, were dropped, were dropped with every sample failed.
        self._kept = self._dropped = self._dropped_failed = 0
        self.filter_counts: dict[str, float] = {}
        """The last step's ``filter_groups/*`` counts: groups finished since the step before
        (``groups_generated``), those dropped as all-equal and those that entered the buffer."""

    # -- producer -------------------------------------------------------------------------

    @property
    def version(self) -> int:
        """The engine's policy version, counted from the step this driver started at."""
        return self._policy_version - self.base_step

    async def _start(self) -> None:
        if self._producer is None:
            self.base_step = self.trainer.step
            await self.control.set_policy_version(self.trainer.step)
            self._policy_version = self.trainer.step
            self._changed = asyncio.Event()
            self._producer = asyncio.get_running_loop().create_task(self._produce(), name="agentloop.producer")

    def _next_record(self) -> int:
        if not self._records:
            self._records = self.trainer.data.next_indices()
        return self._records.pop(0)

    def _launch(self, group: Group) -> None:
        record = self.trainer.data.records[self._group_records[group.index]]
        task = asyncio.get_running_loop().create_task(self._roll(group, record))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _produce(self) -> None:
        assert self._changed is not None
        while self._replay:  # open when the checkpoint was written: admitted then, so no admission now
            self._launch(self._replay.pop(0))
            await asyncio.sleep(0)
        while True:
            if not self.buffer.can_start(self.version) or self._pushing:
                self._changed.clear()
                await self._changed.wait()
                continue
            group = self.buffer.start(self.version)
            self._group_records[group.index] = self._next_record()
            self._launch(group)
            await asyncio.sleep(0)

    async def _roll(self, group: Group, record: dict) -> None:
        assert self._changed is not None
        try:
            rows = make_rows([record], self.trainer.n, step=group.index, tag="train-async")
            # Only these ids enter the wrapper's ledger (evaluation rollouts do not), and they
            # leave it here even when the group fails or is cancelled: also when the cancel
            # (stop()) lands while ``track`` travels to a wrapper in a Ray actor, which then
            # still receives it, before the ``pop`` sent after it.
            ids = [row["request_id"] for row in rows]
            try:
                await self.control.track(ids)
                outputs = await self.fleet.manager.agenerate_outputs(rows, step=group.index)
            finally:
                ledgers = await self.control.pop_ledger_many(ids)
            for _, versions in ledgers:
                group.token_versions.update(v - self.base_step for v in versions)
            if self.fleet.group_judge is not None:  # reward.judge.mode=group: the group is all in
                await self.fleet.group_judge.score(rows, outputs, self.fleet.tokenizer)
            sampler = self.trainer.sampler
            if sampler.active and not sampler.judge(rows, outputs)[rows[0]["group_id"]]:
                # Dropped as it enters the buffer: its room goes to a new group, and its prompt
                # is used up (a checkpoint does not replay it).
                self.buffer.discard(group)
                self._group_records.pop(group.index, None)
                self._dropped += 1
                self._dropped_failed += all(o.failed for o in outputs)
            else:
                self.buffer.finish(group, (rows, outputs))
                self._kept += 1
        except BaseException as exc:
            if not isinstance(exc, asyncio.CancelledError):
                self._error = exc
            raise
        finally:
            self._changed.set()

    # -- consumer -------------------------------------------------------------------------

    async def _next_batch(self) -> tuple[list[dict], Any, list[Group]]:
        await self._start()
        assert self._changed is not None
        while not self.buffer.ready():
            if self._error is not None:
                raise RuntimeError(f"an asynchronous rollout group failed: {self._error!r}") from self._error
            self._check_draw_limit()
            self._changed.clear()
            await self._changed.wait()
        groups = self.buffer.take()
        self.filter_counts = {"filter_groups/groups_generated": float(self._kept + self._dropped),
                              "filter_groups/groups_dropped": float(self._dropped),
                              "filter_groups/groups_kept": float(self._kept)}
        self._kept = self._dropped = self._dropped_failed = 0
        self.trained_groups[self.trainer.step + 1] = [(g.index, self._group_records.pop(g.index)) for g in groups]
        self._changed.set()  # room for more groups
        rows, outputs = join_groups([g.payload for g in groups])
        return rows, self.fleet.batch_from_outputs(outputs), groups

    def _check_draw_limit(self) -> None:
        """``algorithm.filter_groups.max_num_gen_batches`` here: the groups finished since the last
        step's batch may number at most that many batches' worth while the buffer holds too few
        to train."""
        sampler = self.trainer.sampler
        drawn, limit = self._kept + self._dropped, sampler.max_num_gen_batches * sampler.batch_groups
        if not self._kept and self._dropped_failed >= sampler.batch_groups:
            raise RuntimeError(f"step {self.trainer.step}: every sample of the last {self._dropped_failed} groups "
                               "failed, so there is nothing to train on; see the trajectories' errors")
        if sampler.filtering and limit and drawn >= limit and self.buffer.depth < sampler.batch_groups:
            raise RuntimeError(
                f"step {self.trainer.step}: {drawn} groups finished since the last step ({sampler.max_num_gen_batches} "
                f"batches of {sampler.batch_groups}, algorithm.filter_groups.max_num_gen_batches) and {self._dropped} "
                f"were all equal in {sampler.metric}, leaving {self.buffer.depth} to train of the {sampler.batch_groups} "
                "a step needs. The prompts may be too easy or too hard for the policy: raise max_num_gen_batches "
                "(0: no limit)")

    async def _push_weights(self, version: int) -> None:
        from agentloop_trainer.update.weights import iter_policy_weights

        trainer = self.trainer
        buckets = largest = 0
        self._pushing = True
        try:
            await self.control.pause()
            try:
                for bucket in iter_policy_weights(trainer.model, trainer.bucket_bytes):
                    size = sum(t.numel() * t.element_size() for _, t in bucket)
                    buckets, largest = buckets + 1, max(largest, size)
                    await self.control.update_weights(bucket)
            finally:
                await self.control.unpause(version)
                self._policy_version = version
        finally:
            self._pushing = False
        assert self._changed is not None
        self._changed.set()  # the producer may start groups under the new version
        trainer.last_sync = {"perf/sync_buckets": float(buckets), "perf/sync_bucket_peak_mb": largest / 2**20}

    def _learn_all_ranks(self, rows: list[dict], batch: Any) -> dict[str, Any]:
        # Under FSDP the other ranks run the sync step's follower half (PolicyGradientTrainer.train_step
        # without an engine): receive the batch, update their shards, then join each tensor's
        # gather in sync_weights while this rank pushes it (_push_weights). Here the broadcast
        # and the update run in the update thread, so rank 0's rollout goes on meanwhile.
        if self.trainer.world_size > 1:
            from agentloop_trainer.update.fsdp import broadcast_object

            rows, batch = broadcast_object((rows, batch))
        return self.trainer._learn(rows, batch)

    def train_step(self) -> dict[str, Any]:
        """One asynchronous GRPO step: take a batch of groups, update (rollout continues), push."""
        trainer, loop = self.trainer, self.fleet.loop
        t0 = time.perf_counter()
        # The engine's busy time from here, not from the last step's end: an evaluation in
        # between keeps the engine busy outside this step's wall time.
        busy_start = self.fleet.busy_seconds()
        rows, batch, groups = loop.run_until_complete(self._next_batch())
        if batch.failed.all():
            raise RuntimeError(f"all {batch.num_trajectories} rollout samples of step {trainer.step} failed, so "
                               "there is nothing to train on; see the trajectories' errors")
        t_gen = time.perf_counter() - t0
        step = trainer.step
        learned = loop.run_until_complete(asyncio.to_thread(self._learn_all_ranks, rows, batch))
        t2 = time.perf_counter()
        loop.run_until_complete(self._push_weights(step + 1))
        t_sync = time.perf_counter() - t2
        metrics = trainer._step_metrics(rows, batch, learned, t0=t0, t_gen=t_gen, t_sync=t_sync, slept=False,
                                        busy_start=busy_start)
        state = loop.run_until_complete(self.control.rollout_state())
        tokens = Counter()
        for g in groups:
            tokens.update(g.token_versions)
        metrics.update({
            **staleness_metrics(step - self.base_step, groups, self.max_staleness),
            "async/buffer_depth": float(self.buffer.depth),
            "async/groups_in_flight": float(self.buffer.in_flight),
            "async/interrupted_calls": float(state.stats["interrupted_calls"]),
            **(self.filter_counts if trainer.sampler.filtering else {}),
            **{f"async/tokens_version_{v + self.base_step}": float(n) for v, n in sorted(tokens.items())},
        })
        if trainer.step >= trainer.cfg.trainer.total_steps:
            self.stop()
        return metrics

    # -- checkpoints ----------------------------------------------------------------------

    def state(self) -> dict[str, Any]:
        """What ``--resume`` needs to train the prompts the uninterrupted run would have (see the
        module docstring): call it between steps, with the producer's position already in the
        data iterator's state.

        Returns:
            ``started`` (groups started so far), ``open_groups`` (each started, untrained group,
            in start order: ``index``, ``start_version`` as an absolute policy version, ``record``:
            its row of the training data) and ``next_records`` (rows drawn, not yet started).
        """
        return {
            "started": self.buffer.started,
            "open_groups": [{"index": g.index, "start_version": g.start_version + self.base_step,
                             "record": self._group_records[g.index]} for g in self.buffer.open_groups],
            "next_records": list(self._records),
        }

    def load_state(self, state: dict[str, Any] | None) -> None:
        """Restore :meth:`state` before the first step (after ``trainer.step`` is restored).

        None (a checkpoint written in ``trainer.mode=sync``) restores nothing: the run continues
        from the data position alone, which a sync checkpoint leaves exact.

        Raises:
            RuntimeError: when the run already started its producer.
        """
        if self._producer is not None:
            raise RuntimeError("load_state() must come before the first asynchronous step")
        self.base_step = self.trainer.step
        if not state:
            return
        records = len(self.trainer.data.records)
        rows = [int(g["record"]) for g in state["open_groups"]] + [int(r) for r in state["next_records"]]
        if any(not 0 <= r < records for r in rows):
            raise ValueError(f"the checkpoint's asynchronous state names training rows outside the {records} this "
                             "run loaded; resume with the data settings (data.train_files, data.train_size) it "
                             "was written with")
        self._replay = self.buffer.restore(
            int(state["started"]),
            [(int(g["index"]), int(g["start_version"]) - self.base_step) for g in state["open_groups"]])
        self._group_records = {int(g["index"]): int(g["record"]) for g in state["open_groups"]}
        self._records = [int(r) for r in state["next_records"]]

    def stop(self) -> None:
        """Cancel the producer and the groups still rolling out (their work is dropped)."""
        tasks = [t for t in (self._producer, *self._tasks) if t is not None and not t.done()]
        for t in tasks:
            t.cancel()
        if tasks:
            self.fleet.loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
        self._producer = None
        self._tasks.clear()
