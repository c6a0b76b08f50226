"""The staleness-bounded rollout buffer of asynchronous GRPO: pure bookkeeping, no I/O.

The rollout starts whole GRPO groups (a prompt's ``n`` samples together) and finishes them in
any order; the trainer takes ``batch_groups`` finished groups per step. A group's *staleness*
when it is trained at step ``s`` is ``s - v``, where ``v`` is the policy version it started
under (the version of its oldest token; with partial rollout later tokens are newer). Versions
count weight updates: the trainer's step ``s`` trains on the policy of version ``s``.

Trained at step ``s``, a group that started under version ``v`` must have ``v >= s -
max_staleness``: its deadline is step ``v + max_staleness``. The buffer keeps the open groups
(started, not yet trained) *schedulable*: with ``s`` the next step to train, for every version
``u``, at most ``(u + max_staleness - s + 1) * batch_groups`` open groups started under a version
``<= u`` (the deadlines up to ``u + max_staleness`` fit in the batches left before them). Two
rules keep it so:

* **admission** (the producer): a group may start under the current version ``V`` only if the
  open groups plus it still fit: ``open + 1 <= (V + max_staleness - s + 1) * batch_groups``.
  The rollout pauses when this fails and resumes after the next update.
* **taking** (the consumer): a step takes the ``batch_groups`` oldest finished groups, but only
  when the open groups left behind are schedulable for the next step; otherwise it waits
  (for older groups to finish). Taking the oldest groups once they have finished always
  qualifies, so the run never deadlocks.

Schedulable at step ``s`` means no open group is older than ``s - max_staleness`` (take
``u = s - max_staleness - 1``: room for zero groups), so staleness never exceeds the bound.
Open groups are at most ``(max_staleness + 1) * batch_groups``; ``max_staleness=0`` is
synchronous training. Preferring finished groups over unfinished older ones lets fast groups
through while a slow one is not yet due; the schedulability check stops that from starving it
past its deadline. (A plain count-based admission with completion-order consumption does not
bound staleness: the property test in ``test_async_buffer.py`` found the counterexample.)
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Group", "StalenessBuffer", "staleness_metrics"]


@dataclass(eq=False)
class Group:
    """One GRPO group: started together, finished together, trained together."""

    index: int
    """Start order (0, 1, 2...), unique in a run."""
    start_version: int
    """The policy version the group started under."""
    payload: Any = None
    """What the rollout produced for the whole group (set by :meth:`StalenessBuffer.finish`)."""
    finished: bool = False
    """Every sample of the group has ended."""
    token_versions: Counter = field(default_factory=Counter)
    """Generated tokens per policy version (filled by the caller; for metrics)."""


class StalenessBuffer:
    """Admission and batching of GRPO groups under a staleness bound (see the module docstring).

    Args:
        batch_groups: Groups per training step (``data.train_batch_size``).
        max_staleness: Most policy versions between a group's start and its training step.

    Raises:
        ValueError: on ``batch_groups < 1`` or ``max_staleness < 0``.
    """

    def __init__(self, batch_groups: int, max_staleness: int) -> None:
        if batch_groups < 1:
            raise ValueError(f"batch_groups must be at least 1, got {batch_groups}")
        if max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0 (0 is synchronous training), got {max_staleness}")
        self.batch_groups = batch_groups
        self.max_staleness = max_staleness
        self.started = 0
        """Groups started so far."""
        self.trained_steps = 0
        """Batches taken so far (the next :meth:`take` is for this step)."""
        self._open: dict[int, Group] = {}  # started, not yet taken, by index
        self._last_version = 0

    # -- producer -------------------------------------------------------------------------

    def room(self, version: int, step: int | None = None) -> int:
        """How many open groups started under versions ``<= version`` fit before their deadlines,
        from ``step`` (default: the next step to train) on."""
        step = self.trained_steps if step is None else step
        return max(0, (version + self.max_staleness - step + 1) * self.batch_groups)

    def can_start(self, version: int) -> bool:
        """Whether a new group may start under ``version`` (the admission rule)."""
        return len(self._open) + 1 <= self.room(version)

    def _schedulable(self, groups: list[Group], step: int) -> bool:
        """Whether ``groups`` (open at ``step``) can all be trained by their deadlines."""
        counts = Counter(g.start_version for g in groups)
        total = 0
        for version in sorted(counts):
            total += counts[version]
            if total > self.room(version, step):
                return False
        return True

    def start(self, version: int) -> Group:
        """Record that a group starts under ``version``.

        Raises:
            RuntimeError: when the admission rule forbids it (wait for the next update).
            ValueError: when ``version`` is older than a training step already taken.
        """
        if version < self._last_version:
            raise ValueError(f"version {version} is older than the version {self._last_version} a group already "
                             "started under; start groups under the policy version the engine holds now")
        if not self.can_start(version):
            raise RuntimeError(f"{len(self._open)} groups are open; under version {version} with max_staleness "
                               f"{self.max_staleness} at step {self.trained_steps} at most {self.room(version)} "
                               "may be: wait for the next weight update")
        group = Group(index=self.started, start_version=version)
        self._last_version = version
        self.started += 1
        self._open[group.index] = group
        return group

    def finish(self, group: Group, payload: Any) -> None:
        """Record that every sample of ``group`` ended, with what the rollout produced."""
        if self._open.get(group.index) is not group:
            raise ValueError(f"group {group.index} was not started here or was already taken")
        if group.finished:
            raise ValueError(f"group {group.index} already finished")
        group.payload, group.finished = payload, True

    def discard(self, group: Group) -> None:
        """Drop a started group without training it (dynamic sampling: all its samples scored
        the same). It leaves the open groups, so its room goes to a new group; its staleness is
        never counted.

        Raises:
            ValueError: when ``group`` was not started here, was already taken, or finished.
        """
        if self._open.get(group.index) is not group or group.finished:
            raise ValueError(f"group {group.index} is not an open, unfinished group of this buffer")
        del self._open[group.index]

    def restore(self, started: int, groups: list[tuple[int, int]]) -> list[Group]:
        """Reopen, in a fresh buffer, the groups a checkpoint saved as open (``--resume``).

        Each keeps its index (so its request ids, hence its sampling seeds, are the ones the
        uninterrupted run used) and the version it first started under (so its deadline, and
        with it the step that trains it, is the uninterrupted run's). The caller rolls them out
        again from scratch, so their tokens are newer than that version.

        Args:
            started: Groups the saved run had started (the next new group's index).
            groups: ``(index, start_version)`` of each open group, versions counted like this
                buffer's (from its step 0, so a group started before the resume has a version
                ``<= 0``).

        Returns:
            The reopened groups, in start order.

        Raises:
            RuntimeError: when this buffer already started or trained something.
            ValueError: on an index repeated or ``>= started``, or groups that could not all
                be trained by their deadlines (not what a checkpoint of this buffer holds).
        """
        if self.started or self.trained_steps or self._open:
            raise RuntimeError("restore() needs a fresh buffer: restore the checkpoint before the first step")
        indices = [index for index, _ in groups]
        if len(set(indices)) != len(indices) or any(not 0 <= i < started for i in indices):
            raise ValueError(f"open group indices {indices} must be distinct and in [0, {started})")
        reopened = [Group(index=i, start_version=v) for i, v in sorted(groups)]
        if not self._schedulable(reopened, 0):
            raise ValueError(f"the open groups (index, version) {sorted(groups)} cannot all be trained within "
                             f"max_staleness {self.max_staleness} with {self.batch_groups} groups a step; the "
                             "checkpoint was written with other trainer.max_staleness or data.train_batch_size "
                             "settings: resume with those")
        self.started = started
        self._open = {g.index: g for g in reopened}
        self._last_version = max((g.start_version for g in reopened), default=0)
        return reopened

    @property
    def open_groups(self) -> list[Group]:
        """Started, not yet taken, in start order (what a checkpoint must replay)."""
        return sorted(self._open.values(), key=lambda g: g.index)

    # -- consumer -------------------------------------------------------------------------

    def due(self) -> list[Group]:
        """The open groups whose deadline is the next step (it must train them)."""
        return [g for g in self._open.values() if g.start_version + self.max_staleness <= self.trained_steps]

    @property
    def depth(self) -> int:
        """Finished groups waiting to be trained."""
        return sum(g.finished for g in self._open.values())

    @property
    def in_flight(self) -> int:
        """Started groups still rolling out."""
        return sum(not g.finished for g in self._open.values())

    def _candidate(self) -> list[Group] | None:
        finished = sorted((g for g in self._open.values() if g.finished), key=lambda g: g.index)
        if len(finished) < self.batch_groups:
            return None
        batch = finished[: self.batch_groups]
        taken = set(batch)
        left = [g for g in self._open.values() if g not in taken]
        return batch if self._schedulable(left, self.trained_steps + 1) else None

    def ready(self) -> bool:
        """Whether :meth:`take` can build the next step's batch now."""
        return self._candidate() is not None

    def take(self) -> list[Group]:
        """The next step's batch: the oldest finished groups (see the module docstring).

        Returns:
            ``batch_groups`` whole groups, in start order.

        Raises:
            RuntimeError: when not :meth:`ready` (too few groups finished, or an older group
                must finish first to meet its deadline).
        """
        batch = self._candidate()
        if batch is None:
            raise RuntimeError(f"step {self.trained_steps} is not ready: {self.depth} groups finished of "
                               f"{self.batch_groups} needed, {sum(not g.finished for g in self.due())} groups "
                               "due this step still running")
        for g in batch:
            del self._open[g.index]
        self.trained_steps += 1
        return batch


def staleness_metrics(step: int, groups: list[Group], max_staleness: int) -> dict[str, float]:
    """Per-step metrics of a taken batch: ``staleness/{mean,max}``, ``staleness/hist_<k>``
    (fraction of groups ``k`` versions stale, for ``k = 0..max_staleness``) and
    ``staleness/tokens_lag_<k>`` (generated tokens sampled ``k`` versions before ``step``)."""
    lags = [step - g.start_version for g in groups]
    out: dict[str, float] = {
        "staleness/mean": sum(lags) / len(lags) if lags else 0.0,
        "staleness/max": float(max(lags, default=0)),
    }
    for k in range(max_staleness + 1):
        out[f"staleness/hist_{k}"] = sum(lag == k for lag in lags) / len(lags) if lags else 0.0
    tokens: Counter = Counter()
    for g in groups:
        for version, n in g.token_versions.items():
            tokens[step - version] += n
    for lag, n in sorted(tokens.items()):
        out[f"staleness/tokens_lag_{lag}"] = float(n)
    return out
