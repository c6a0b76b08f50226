"""DAPO's dynamic sampling and over-long reward shaping (verl's ``algorithm.filter_groups`` and
``reward_model.overlong_buffer``), applied to whole GRPO groups of rollout outputs before they
become a training batch: the sync step rolls out prompt batches through :meth:`DynamicSampler.sample`,
the asynchronous driver judges each group as it finishes, before it enters the buffer.

**Over-long shaping.** A trajectory whose response is longer than ``data.max_response_length -
buffer_len`` tokens gets :func:`overlong_penalty` added to its reward. The length is verl's
*valid response length*: every token of the response region (generated and tool/user tokens),
of the trajectory's last segment, capped at ``data.max_response_length`` (what a batch row
holds). Failed samples and samples without a reward are not shaped. Each shaped trajectory's
penalty (0 when it was short enough) is kept in its last segment's metrics as
``reward/overlong_penalty``.

**Dynamic sampling.** Each trajectory gets the ``filter_groups.metric`` value
(:func:`trajectory_metric`); a group is kept when its values are not all equal
(:func:`has_spread`): an all-equal group's GRPO advantages are all 0, so it would cost an update
and teach nothing. A failed sample has no value (its reward 0 was never measured), so it
neither creates nor hides a spread: ``[failed, 1, 1, 1]`` is dropped, ``[failed, 0, 1, 1]`` kept
(the failed sample is then masked out of the loss as always), and a group with fewer than two
samples that did not fail is dropped.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from agentloop_trainer.reward.settings import OverlongBufferSection
from agentloop_trainer.rollout.settings import FILTER_METRICS, FilterGroupsSection

if TYPE_CHECKING:
    from agentloop_core.output import AgentLoopOutput

__all__ = ["PENALTY_KEY", "DynamicSampler", "has_spread", "join_groups", "overlong_metrics", "overlong_penalty",
           "trajectory_metric"]

PENALTY_KEY = "reward/overlong_penalty"
"""The per-sample metric holding a shaped trajectory's over-long penalty (on its last segment)."""


UNLIMITED_NOTICE_EVERY = 10
"""Without a ``max_num_gen_batches`` limit, warn after every this many prompt batches of one step."""


def overlong_penalty(length: int, response_length: int, buffer_len: int, penalty_factor: float) -> float:
    """DAPO's soft over-long punishment of one response: 0 up to ``response_length -
    buffer_len`` tokens, then falling linearly to ``-penalty_factor`` at ``response_length``
    (and staying there beyond it).

    Args:
        length: The response's length in tokens.
        response_length: The response budget (``data.max_response_length``).
        buffer_len: ``reward_model.overlong_buffer.len`` (at least 1).
        penalty_factor: ``reward_model.overlong_buffer.penalty_factor``.

    Returns:
        ``-min(1, (length - (response_length - buffer_len)) / buffer_len) * penalty_factor``
        when that excess is positive, else 0.
    """
    over = length - (response_length - buffer_len)
    if over <= 0:
        return 0.0
    return -min(1.0, over / buffer_len) * penalty_factor


def has_spread(values: Sequence[float | None]) -> bool:
    """Whether a group teaches something: at least two of its values are known (not None, i.e.
    not failed) and they are not all equal. Equality is exact: the 0/1 rewards DAPO filters
    are exact, and a tolerance would drop groups a continuous reward does separate."""
    known = [v for v in values if v is not None]
    return len(known) >= 2 and min(known) != max(known)


def _trajectories(outputs: Sequence[AgentLoopOutput]) -> dict[int, list[AgentLoopOutput]]:
    """Outputs by trajectory (an output without ``trajectory_index`` is one of its own, by position),
    segments in order."""
    out: dict[int, list[AgentLoopOutput]] = {}
    for i, o in enumerate(outputs):
        out.setdefault(i if o.trajectory_index is None else int(o.trajectory_index), []).append(o)
    return {t: sorted(segs, key=lambda s: s.segment_index) for t, segs in out.items()}


def _reward(segments: Sequence[AgentLoopOutput]) -> float | None:
    """A trajectory's reward as the batch will read it: None when it failed or has none."""
    if any(s.failed for s in segments):
        return None
    r = segments[-1].reward_score
    return float(r) if r is not None and math.isfinite(float(r)) else None


def trajectory_metric(metric: str, segments: Sequence[AgentLoopOutput], unshaped: float | None) -> float | None:
    """One trajectory's ``algorithm.filter_groups.metric`` value; None when it failed or has no reward.

    Args:
        metric: acc (the reward function's ``acc`` when it returned one, which the scorer keeps
            as ``reward/acc``; else the reward before shaping, which the built-in 0/1 scorers
            make the accuracy) | score (the reward before over-long shaping) | seq_reward |
            seq_final_reward (the reward after shaping: agentloop puts no KL in the reward, so
            verl's two are the same here).
        segments: The trajectory's outputs, after shaping.
        unshaped: Its reward before shaping.

    Raises:
        ValueError: an unknown metric, listing the valid ones.
    """
    if metric not in FILTER_METRICS:
        raise ValueError(f"unknown algorithm.filter_groups.metric {metric!r}; valid: {', '.join(FILTER_METRICS)}")
    if unshaped is None:
        return None
    if metric == "acc":
        acc = segments[-1].metrics.get("reward/acc")
        return float(acc) if isinstance(acc, (int, float)) and not isinstance(acc, bool) else unshaped
    if metric == "score":
        return unshaped
    return _reward(segments)


def join_groups(parts: Sequence[tuple[Sequence[dict], Sequence[AgentLoopOutput]]]) -> tuple[list[dict], list[Any]]:
    """Rows and outputs of several rollouts as one: each part's ``trajectory_index`` (an index into
    its own rows) is shifted past the rows before it."""
    import dataclasses

    rows: list[dict] = []
    outputs: list[Any] = []
    for part_rows, part_outputs in parts:
        offset = len(rows)
        rows.extend(part_rows)
        outputs.extend(dataclasses.replace(o, trajectory_index=offset + (o.trajectory_index or 0))
                       for o in part_outputs)
    return rows, outputs


def _select(rows: Sequence[dict], outputs: Sequence[AgentLoopOutput], groups: set[str]) -> tuple[list[dict], list[Any]]:
    """The rows of ``groups`` and their outputs, ``trajectory_index`` renumbered into the rows kept."""
    import dataclasses

    new_index = {}
    kept_rows: list[dict] = []
    for i, row in enumerate(rows):
        if row["group_id"] in groups:
            new_index[i] = len(kept_rows)
            kept_rows.append(row)
    kept = [dataclasses.replace(o, trajectory_index=new_index[t])
            for t, segs in _trajectories(outputs).items() if t in new_index for o in segs]
    return kept_rows, kept


def overlong_metrics(batch: Any) -> dict[str, float]:
    """Over-long shaping of a training batch, per trajectory: ``reward/overlong_count`` (penalized),
    ``reward/overlong_fraction`` (of the shaped ones) and ``reward/overlong_penalty_mean`` (the
    mean penalty of the penalized ones; 0 when none was)."""
    penalties = [float(batch.sample_metrics[r][PENALTY_KEY]) for r in batch.last_segment_rows().tolist()
                 if PENALTY_KEY in batch.sample_metrics[r]]
    hit = [p for p in penalties if p < 0]
    return {"reward/overlong_count": float(len(hit)),
            "reward/overlong_fraction": len(hit) / len(penalties) if penalties else 0.0,
            "reward/overlong_penalty_mean": sum(hit) / len(hit) if hit else 0.0}


class DynamicSampler:
    """Over-long shaping and the group filter of one run (see the module docstring).

    Args:
        filter_groups: The ``algorithm.filter_groups`` section.
        overlong_buffer: The ``reward_model.overlong_buffer`` section.
        response_length: ``data.max_response_length``.
        batch_groups: ``data.train_batch_size`` (groups a step trains).
    """

    def __init__(self, filter_groups: FilterGroupsSection, overlong_buffer: OverlongBufferSection, *,
                 response_length: int, batch_groups: int) -> None:
        fg, ob = filter_groups, overlong_buffer
        self.filtering = bool(fg.enable)
        """``algorithm.filter_groups.enable``."""
        self.shaping = bool(ob.enable)
        """``reward_model.overlong_buffer.enable``."""
        self.metric, self.max_num_gen_batches, self.on_limit = str(fg.metric), int(fg.max_num_gen_batches), fg.on_limit
        self.buffer_len, self.penalty_factor = int(ob.len), float(ob.penalty_factor)
        self.response_length = int(response_length)
        """The response budget (``data.max_response_length``)."""
        self.batch_groups = int(batch_groups)

    @property
    def active(self) -> bool:
        """Whether either is on (else the trainer rolls out as before)."""
        return self.filtering or self.shaping

    def judge(self, rows: Sequence[dict], outputs: Sequence[AgentLoopOutput]) -> dict[str, bool]:
        """Shape ``outputs``' rewards in place (when enabled) and say which groups to keep.

        Args:
            rows: The rows rolled out (``outputs``' ``trajectory_index`` indexes them).
            outputs: Their outputs.

        Returns:
            group id -> whether it is kept (every group without ``filter_groups.enable``), in
            the rows' order.
        """
        values: dict[str, list[float | None]] = {}
        by_trajectory = _trajectories(outputs)
        for t, segs in by_trajectory.items():
            unshaped = _reward(segs)
            if self.shaping and unshaped is not None:
                length = min(len(segs[-1].response_ids), self.response_length)
                penalty = overlong_penalty(length, self.response_length, self.buffer_len, self.penalty_factor)
                for s in segs:  # every segment carries the trajectory's reward
                    if s.reward_score is not None:
                        s.reward_score = float(s.reward_score) + penalty
                segs[-1].metrics[PENALTY_KEY] = penalty
            values.setdefault(rows[t]["group_id"], []).append(trajectory_metric(self.metric, segs, unshaped)
                                                              if self.filtering else None)
        order = list(dict.fromkeys(row["group_id"] for row in rows))
        return {g: not self.filtering or has_spread(values.get(g, [])) for g in order}

    def sample(self, fleet: Any, data: Any, n: int, step: int,
               log: Callable[[str], None] = print) -> tuple[list[dict], Any, dict[str, float]]:
        """One sync step's rollout: prompt batches until ``data.train_batch_size`` groups are kept.

        The first batch's rows are the ones a run without the filter rolls out (same request
        ids, hence sampling seeds); later ones are tagged ``train-gen<k>``. Qualifying groups
        beyond the step's size are dropped (``filter_groups/groups_trimmed``), as verl does;
        their prompts are used up.

        Args:
            fleet: The :class:`~agentloop_trainer.rollout.rollouts.RolloutFleet`.
            data: The training :class:`~agentloop_trainer.data.iterator.DataIterator`.
            n: Samples per prompt.
            step: The step being rolled out.
            log: Where the ``on_limit=train_kept`` warning goes.

        Returns:
            ``(rows, batch, metrics)``: the kept groups' rows and their ``RolloutBatch``, and
            ``filter_groups/*`` metrics. A prompt batch whose every sample failed is returned
            as it is (the trainer's all-failed error reports it).

        Raises:
            RuntimeError: ``max_num_gen_batches`` batches kept too few groups and ``on_limit``
                is ``error``, or kept none at all.
        """
        from agentloop_trainer.rollout.rollouts import make_rows

        parts: list[tuple[list[dict], list[Any]]] = []
        kept = generated = dropped = trimmed = with_failed = batches = 0
        while kept < self.batch_groups:
            if self.max_num_gen_batches and batches >= self.max_num_gen_batches:
                msg = (f"step {step}: {batches} prompt batches (algorithm.filter_groups.max_num_gen_batches="
                       f"{self.max_num_gen_batches}) kept {kept} groups whose {self.metric} differs of the "
                       f"{self.batch_groups} a step trains (data.train_batch_size); {dropped} of {generated} were "
                       "all equal")
                if not kept:
                    raise RuntimeError(msg + ". With no group kept there is nothing to train on (even with "
                                       "on_limit=train_kept): the prompts may be too easy or too hard for the "
                                       "policy; raise max_num_gen_batches (0: no limit) or change the data")
                if self.on_limit != "train_kept":
                    raise RuntimeError(msg + ". The prompts may be too easy or too hard for the policy: raise "
                                       "max_num_gen_batches (0: no limit), or set algorithm.filter_groups.on_limit="
                                       "train_kept to train on the groups kept")
                log(f"WARNING: {msg}; training on those {kept} (algorithm.filter_groups.on_limit=train_kept)")
                break
            if batches and not self.max_num_gen_batches and batches % UNLIMITED_NOTICE_EVERY == 0:
                log(f"WARNING: step {step}: {batches} prompt batches so far kept {kept} of the {self.batch_groups} "
                    f"groups a step trains; {dropped} of {generated} had the same {self.metric} in every sample. "
                    "algorithm.filter_groups.max_num_gen_batches=0 draws until the step is full: set a limit to stop")
            batches += 1
            rows = make_rows(data.next_batch(), n, step=step, tag="train" if batches == 1 else f"train-gen{batches}")
            outputs = fleet.generate_outputs(rows, step=step)
            if all(o.failed for o in outputs):
                return rows, fleet.batch_from_outputs(outputs), {}
            verdict = self.judge(rows, outputs)
            failed_groups = {rows[t]["group_id"] for t, segs in _trajectories(outputs).items()
                             if any(s.failed for s in segs)}
            take: set[str] = set()
            for group, keep in verdict.items():
                generated += 1
                with_failed += group in failed_groups
                if not keep:
                    dropped += 1
                elif kept < self.batch_groups:
                    take.add(group)
                    kept += 1
                else:
                    trimmed += 1
            if take:
                parts.append(_select(rows, outputs, take))
        rows, outputs = join_groups(parts)
        metrics = {"filter_groups/gen_batches": float(batches), "filter_groups/groups_generated": float(generated),
                   "filter_groups/groups_dropped": float(dropped), "filter_groups/groups_trimmed": float(trimmed),
                   "filter_groups/groups_kept": float(kept), "filter_groups/groups_with_failed": float(with_failed),
                   "train/num_gen_batches": float(batches)} if self.filtering else {}
        return rows, fleet.batch_from_outputs(outputs), metrics
