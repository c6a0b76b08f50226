"""The last check on a batch's rewards before advantages: every reward, and every per-turn
reward, finite in float32 (see :mod:`agentloop_trainer.reward.limits`).

The reward hook already fails a sample whose reward is not finite as float32; this catches what
reached the batch another way (a loop's own reward with no reward function, a custom
``reward_fn``, a batch built by hand). A trajectory that fails the check is marked failed in
place (``batch.failed``, reward 0, ``sample_metrics["reward_not_finite"] = 1`` and its error on
its last row), so the advantage of every other sample of its group stays finite: the group is
computed as if that sample had failed in the rollout (reward 0 in the baseline, its own tokens
out of the loss, counted in ``rollout/num_failed``).
"""

from __future__ import annotations

import logging
from typing import Any

from agentloop_trainer.reward.limits import not_finite_reason

__all__ = ["fail_non_finite_rewards"]

logger = logging.getLogger(__name__)


def fail_non_finite_rewards(batch: Any) -> int:
    """Mark failed, in place, each trajectory of ``batch`` (a
    :class:`~agentloop_core.batch.RolloutBatch`) whose reward or per-turn rewards are not
    finite in float32; returns how many it marked."""
    import numpy as np

    traj = np.asarray(batch.trajectory_index)
    failed = np.asarray(batch.failed, dtype=bool)
    marked = 0
    for last in batch.last_segment_rows().tolist():
        if failed[last]:
            continue
        extra = batch.extra_fields[last] if len(batch.extra_fields) > last else {}
        why = not_finite_reason(float(batch.rewards[last]), extra.get("turn_rewards"))
        if why is None:
            continue
        rows = traj == traj[last]
        error = (f"RewardNotFiniteError: {why} (advantages are computed in float32); return rewards within "
                 "+-3.4e38, or scale them down")
        logger.warning("trajectory %d left out of the update: %s", int(traj[last]), error)
        failed[rows] = True
        batch.rewards[rows] = 0.0
        if getattr(batch, "has_reward", None) is not None:
            batch.has_reward[rows] = False
        if len(batch.sample_metrics) > last:
            batch.sample_metrics[last].update(failed=True, error=error, reward_not_finite=1.0)
        marked += 1
    batch.failed = failed
    return marked
