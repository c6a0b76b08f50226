"""The turns of each trajectory in a rollout batch, and the reward each turn earned.

A **turn** is one contiguous run of model tokens (``response_mask == 1``) in a row's
response: the tool results and user messages between two runs (mask 0) belong to no turn,
and the loss never sees them. A trajectory split into segments (``agentloop_core.segments``)
counts its turns on through its segments in ``segment_index`` order, so turn ``k`` means the
same thing however the loop cut the trajectory. Turns are read from the mask, not declared
by the loop: every loop that keeps the protocol's mask gets them for free. (Two generate
calls with nothing at all between them merge into one run, hence one turn; no shipped loop
makes such calls.)

**Per-turn rewards.** A loop declares them in ``extra_fields["turn_rewards"]``, one number per
turn, read from the trajectory's last segment (where per-trajectory values live): ``env_agent``
records each environment step's reward on the turn that was stepped, ``tool_agent`` each tool
call's reward on the turn that made the call and each interaction reply's score on the turn it
answered. A reward function may return per-turn scores too (see
:func:`agentloop_trainer.reward.scoring.turn_rewards_of`); the scorer keeps, per
``reward.source``, only the lists that are part of the trajectory's final reward.

**The outcome rule** (:func:`turn_rewards`): the declared rewards are *parts of* the
trajectory's final reward ``R`` (``RolloutBatch.rewards``); whatever of ``R`` they do not
account for (``R - sum(declared)``: a function's or judge's score, a tool's ``calc_reward``, an
interaction's ``calculate_score``) is the outcome and goes to the last turn. So the per-turn
rewards always sum to ``R``: per-turn credit moves credit between a trajectory's turns and
never changes what the trajectory is worth, and a loop that already summed its step rewards
into ``R`` (``env_agent``) is never counted twice. A declared list whose length is not the
trajectory's turn count is an error, never truncated or padded.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["Trajectory", "TurnSpan", "batch_trajectories", "mask_runs", "turn_rewards"]


@dataclass(frozen=True)
class TurnSpan:
    """Where one turn's tokens sit in the batch."""

    row: int
    """The batch row (segment) holding the turn."""
    start: int
    """First response column of the turn."""
    end: int
    """One past its last response column."""
    observation: bytes
    """Digest of every token the model saw before the turn (the row's prompt and its response
    up to ``start``): equal digests mean equal observations (GiGPO's anchor states)."""


@dataclass(frozen=True)
class Trajectory:
    """One trajectory's turns and per-turn rewards, as the credit modes read them."""

    index: int
    """Its ``trajectory_index``."""
    group: Any
    """Its prompt's group id (the samples of one prompt share it)."""
    reward: float
    """The final reward ``R`` (what ``algorithm.turn_credit=trajectory`` uses)."""
    turns: tuple[TurnSpan, ...]
    """Its turns in order (none for a failed sample)."""
    rewards: tuple[float, ...]
    """One reward per turn, summing to ``reward`` (:func:`turn_rewards`)."""


def mask_runs(mask: Any) -> list[tuple[int, int]]:
    """``(start, end)`` of each contiguous run of ones in a 1-D response mask, in order."""
    import numpy as np

    m = (np.asarray(mask) == 1).astype(np.int8)
    edges = np.diff(np.concatenate(([0], m, [0])))
    return list(zip(np.flatnonzero(edges == 1).tolist(), np.flatnonzero(edges == -1).tolist(), strict=True))


def turn_rewards(declared: Any, num_turns: int, reward: float, where: str = "the trajectory") -> list[float]:
    """Per-turn rewards of a trajectory by the outcome rule (see the module docstring).

    Args:
        declared: ``extra_fields["turn_rewards"]``: one number per turn, or None / empty
            (no per-turn rewards: all of ``reward`` goes to the last turn).
        num_turns: The trajectory's turns (runs of mask 1 over its segments).
        reward: Its final reward ``R``.
        where: Names the trajectory in errors.

    Returns:
        ``num_turns`` rewards summing to ``reward`` (empty for no turns).

    Raises:
        ValueError: ``declared`` is not a list of finite numbers, or its length is not
            ``num_turns``.
    """
    values = [] if declared is None else declared
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence) or not all(
            isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in values):
        raise ValueError(f"{where} has extra_fields['turn_rewards'] = {declared!r:.200}; it must be a list of "
                         "finite numbers, one per turn")
    if not num_turns:
        if values:
            raise ValueError(f"{where} declares {len(values)} turn rewards but generated no tokens (no turn)")
        return []
    if values and len(values) != num_turns:
        raise ValueError(
            f"{where} declares {len(values)} turn rewards (extra_fields['turn_rewards'], from its loop or reward "
            f"function) but its response_mask holds {num_turns} turns (runs of model tokens, counted over its "
            "segments); give exactly one reward per generate call that produced tokens (0.0 for a turn without one)")
    out = [float(v) for v in values] or [0.0] * num_turns
    out[-1] += float(reward) - math.fsum(out)
    return out


def batch_trajectories(batch: Any, group_ids: Sequence[Any], *, observations: bool = False) -> list[Trajectory]:
    """The trajectories of a :class:`~agentloop_core.batch.RolloutBatch`, ascending by index.

    Args:
        batch: The batch.
        group_ids: ``B`` per-row group ids (the prompt's; equal within a trajectory).
        observations: Hash each turn's observation (``TurnSpan.observation``; only
            ``step_group`` needs them); False leaves them empty.

    Raises:
        ValueError: a trajectory's declared turn rewards do not match its turns
            (:func:`turn_rewards`), or ``group_ids`` has the wrong length.
    """
    import numpy as np

    if len(group_ids) != len(batch):
        raise ValueError(f"group_ids has {len(group_ids)} entries but the batch has {len(batch)} rows")
    traj = np.asarray(batch.trajectory_index)
    seg = np.asarray(batch.segment_index)
    P = batch.prompts.shape[1]
    rows_of: dict[int, list[int]] = {}
    for b in np.lexsort((seg, traj)).tolist():
        rows_of.setdefault(int(traj[b]), []).append(b)
    out = []
    for t, rows in sorted(rows_of.items()):
        last = rows[-1]
        failed = bool(np.asarray(batch.failed)[rows].any())
        spans: list[TurnSpan] = []
        for b in [] if failed else rows:
            runs = mask_runs(batch.response_mask[b])
            if observations:
                prompt = batch.prompts[b][batch.attention_mask[b][:P] == 1]
                seen = hashlib.blake2b(np.ascontiguousarray(prompt, dtype=np.int64).tobytes(), digest_size=16)
                done = 0
                for start, end in runs:
                    seen.update(np.ascontiguousarray(batch.responses[b][done:start], dtype=np.int64).tobytes())
                    done = start
                    spans.append(TurnSpan(b, start, end, seen.copy().digest()))
            else:
                spans.extend(TurnSpan(b, start, end, b"") for start, end in runs)
        reward = float(batch.rewards[last])
        extra = batch.extra_fields[last] if len(batch.extra_fields) > last else {}
        name = (batch.sample_metrics[last] if len(batch.sample_metrics) > last else {}).get("agent_name")
        where = f"trajectory {t}" + (f" (loop {name!r})" if name else "")
        declared = None if failed else extra.get("turn_rewards")
        out.append(Trajectory(t, group_ids[last], reward, tuple(spans),
                              tuple(turn_rewards(declared, len(spans), reward, where))))
    return out
