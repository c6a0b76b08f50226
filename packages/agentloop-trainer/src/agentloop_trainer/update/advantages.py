"""Group advantages: each reward against its group's (a prompt's samples): GRPO (mean and
std), Dr. GRPO (mean only), RLOO (the mean of the other samples); computed once per
trajectory and broadcast to its rows when a loop split the trajectory into segments
(see ``agentloop_core.segments``; :func:`trajectory_advantages`).

Rewards are torch tensors shaped ``[B]`` (one per row).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

ADV_ESTIMATORS: tuple[str, ...] = ("grpo", "dr_grpo", "rloo")
"""Values of ``algorithm.adv_estimator``."""


def group_advantages(rewards: Any, group_ids: Sequence[Any], *, norm_by_std: bool = True, eps: float = 1e-6) -> Any:
    """GRPO advantages: each reward minus its group's mean, divided by the group's std.

    Args:
        rewards: ``[B]`` scalar rewards.
        group_ids: ``B`` hashable ids; samples of one prompt share an id.
        norm_by_std: Divide by the group's standard deviation (GRPO). False: only subtract the
            mean (Dr. GRPO), which does not up-weight groups whose rewards barely differ.
        eps: Added to the std so a group with identical rewards gets advantage 0, not NaN.

    Returns:
        ``[B]`` advantages (float32). A group of one sample gets 0: it has no baseline.

    Raises:
        ValueError: when ``group_ids`` and ``rewards`` differ in length.
    """
    import torch

    rewards = torch.as_tensor(rewards, dtype=torch.float32)
    if len(group_ids) != rewards.shape[0]:
        raise ValueError(f"group_ids has {len(group_ids)} entries but rewards has {rewards.shape[0]}")
    index: dict[Any, list[int]] = {}
    for i, g in enumerate(group_ids):
        index.setdefault(g, []).append(i)
    adv = torch.zeros_like(rewards)
    for members in index.values():
        if len(members) < 2:
            continue
        idx = torch.tensor(members)
        r = rewards[idx]
        centred = r - r.mean()
        adv[idx] = centred / (r.std(unbiased=True) + eps) if norm_by_std else centred
    return adv


def leave_one_out_advantages(rewards: Any, group_ids: Sequence[Any]) -> Any:
    """RLOO advantages: each reward minus the mean of the *other* rewards of its group,
    ``r_i - (sum_j r_j - r_i) / (n - 1)`` (equal to ``n / (n - 1) * (r_i - mean)``).

    Args:
        rewards: ``[B]`` scalar rewards.
        group_ids: ``B`` hashable ids; samples of one prompt share an id.

    Returns:
        ``[B]`` advantages (float32). A group of one sample gets 0: it has no other samples
        (``rollout.n=1`` is refused at config load with ``adv_estimator=rloo``).

    Raises:
        ValueError: when ``group_ids`` and ``rewards`` differ in length.
    """
    import torch

    rewards = torch.as_tensor(rewards, dtype=torch.float32)
    if len(group_ids) != rewards.shape[0]:
        raise ValueError(f"group_ids has {len(group_ids)} entries but rewards has {rewards.shape[0]}")
    number: dict[Any, int] = {}
    inverse = torch.tensor([number.setdefault(g, len(number)) for g in group_ids], dtype=torch.long)
    sums = torch.zeros(len(number)).index_add_(0, inverse, rewards)[inverse]
    counts = torch.zeros(len(number)).index_add_(0, inverse, torch.ones_like(rewards))[inverse]
    others = (sums - rewards) / (counts - 1).clamp(min=1.0)
    return torch.where(counts > 1, rewards - others, torch.zeros_like(rewards))


def trajectory_advantages(
    estimator: str, rewards: Any, group_ids: Sequence[Any], trajectory_ids: Sequence[Any]
) -> Any:
    """Advantages for rows that may be segments: computed once per trajectory (a group counts
    each of its trajectories once, not each segment) and broadcast to every row of it.

    Args:
        estimator: ``grpo``, ``dr_grpo`` or ``rloo``.
        rewards: ``[B]`` per-row rewards; the rows of one trajectory hold its reward.
        group_ids: ``B`` per-row group ids (the prompt's); equal within a trajectory.
        trajectory_ids: ``B`` per-row trajectory ids.

    Returns:
        ``[B]`` advantages; for one row per trajectory, exactly :func:`compute_advantages`.

    Raises:
        ValueError: lengths differ, or the rows of one trajectory disagree on reward or group.
    """
    import torch

    rewards = torch.as_tensor(rewards, dtype=torch.float32)
    if not len(group_ids) == len(trajectory_ids) == rewards.shape[0]:
        raise ValueError(f"rewards has {rewards.shape[0]} rows, group_ids {len(group_ids)} and "
                         f"trajectory_ids {len(trajectory_ids)}; give one of each per row")
    first: dict[Any, int] = {}
    for i, t in enumerate(trajectory_ids):
        j = first.setdefault(t, i)
        if j != i and (group_ids[i] != group_ids[j] or not torch.equal(rewards[i], rewards[j])):
            raise ValueError(
                f"rows {j} and {i} of trajectory {t!r} have rewards {float(rewards[j])}/{float(rewards[i])} and "
                f"groups {group_ids[j]!r}/{group_ids[i]!r}; every segment of a trajectory carries its reward and group"
            )
    heads = list(first.values())
    adv = compute_advantages(estimator, rewards[heads], [group_ids[i] for i in heads])
    position = {t: k for k, t in enumerate(first)}
    return adv[torch.tensor([position[t] for t in trajectory_ids], dtype=torch.long)]


def compute_advantages(estimator: str, rewards: Any, group_ids: Sequence[Any]) -> Any:
    """Advantages by estimator name (``grpo``, ``dr_grpo`` or ``rloo``).

    Raises:
        ValueError: on an unknown estimator, listing the valid ones.
    """
    if estimator not in ADV_ESTIMATORS:
        raise ValueError(f"unknown adv_estimator {estimator!r}; valid: {', '.join(ADV_ESTIMATORS)}")
    if estimator == "rloo":
        return leave_one_out_advantages(rewards, group_ids)
    return group_advantages(rewards, group_ids, norm_by_std=estimator == "grpo")
