"""Group advantages: each reward against its group's (a prompt's samples): GRPO (mean and
std), Dr. GRPO (mean only), RLOO (the mean of the other samples); computed once per
trajectory and broadcast to its rows when a loop split the trajectory into segments
(see ``agentloop_core.segments``; :func:`trajectory_advantages`).

The estimators are a table (:data:`ADVANTAGE_ESTIMATORS`, name -> :class:`AdvantageEstimator`):
``algorithm.adv_estimator`` is a name in it, and the config checks read its constraints from it
(the group size it needs, whether it needs a critic). A new estimator is one registration::

    @register_advantage_estimator("mean_baseline", min_group_size=2, why="a baseline needs 2 samples")
    def mean_baseline(rewards, group_ids):
        ...  # [B] float32 rewards -> [B] advantages

Rewards are torch tensors shaped ``[B]`` (one per row).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from agentloop_trainer.update.tables import AlgorithmTable

Estimate = Callable[[Any, Sequence[Any]], Any]
"""``(rewards, group_ids) -> advantages``: ``[B]`` float32 rewards and ``B`` group ids in,
``[B]`` advantages out."""


@dataclass(frozen=True)
class AdvantageEstimator:
    """One row of :data:`ADVANTAGE_ESTIMATORS`: the function and what it needs."""

    name: str
    """The value of ``algorithm.adv_estimator``."""
    estimate: Estimate
    """The advantages of a batch (see :data:`Estimate`)."""
    min_group_size: int = 1
    """The least ``actor_rollout_ref.rollout.n`` it works with; config load refuses fewer."""
    why: str = ""
    """Why it needs ``min_group_size`` samples (ends the config error)."""
    needs_critic: bool = False
    """It reads a value model's estimates: the trainer trains a critic (``critic.*``) beside the
    policy, and config load asks for the critic's keys."""
    verl_name: str | None = None
    """verl's name for the same estimator (None: verl has none)."""
    summary: str = ""
    """One line for docs and ``--help``."""


ADVANTAGE_ESTIMATORS: AlgorithmTable[AdvantageEstimator] = AlgorithmTable(
    "adv_estimator", "agentloop.advantage_estimators", AdvantageEstimator,
    "Register one with agentloop_trainer.update.advantages.register_advantage_estimator, in code or from the module "
    "an entry point of 'agentloop.advantage_estimators' names (see docs/beyond-grpo.md).",
)
"""Values of ``algorithm.adv_estimator``: name -> :class:`AdvantageEstimator`."""


def register_advantage_estimator(
    name: str, *, min_group_size: int = 1, why: str = "", needs_critic: bool = False,
    verl_name: str | None = None, summary: str = "",
) -> Callable[[Estimate], Estimate]:
    """Decorator: add the function to :data:`ADVANTAGE_ESTIMATORS` under ``name`` (then
    ``algorithm.adv_estimator=name`` loads and :func:`compute_advantages` calls it).

    Raises:
        ValueError: ``min_group_size`` below 1, or another estimator holds the name.
    """
    if min_group_size < 1:
        raise ValueError(f"advantage estimator {name!r}: min_group_size must be at least 1, got {min_group_size}")

    def register(estimate: Estimate) -> Estimate:
        ADVANTAGE_ESTIMATORS.add(name, AdvantageEstimator(name, estimate, min_group_size, why, needs_critic,
                                                          verl_name, summary))
        return estimate

    return register


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
        estimator: A name in :data:`ADVANTAGE_ESTIMATORS` (``grpo``, ``dr_grpo``, ``rloo``...).
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
    """Advantages by estimator name (a name in :data:`ADVANTAGE_ESTIMATORS`: ``grpo``,
    ``dr_grpo``, ``rloo`` and any registered one).

    Raises:
        ValueError: on an unknown estimator, listing the valid ones; ``group_ids`` and ``rewards``
            of different lengths; an estimator that returns another shape than ``[B]``.
    """
    import torch

    record = ADVANTAGE_ESTIMATORS.get(estimator)
    rewards = torch.as_tensor(rewards, dtype=torch.float32)
    if len(group_ids) != rewards.shape[0]:
        raise ValueError(f"group_ids has {len(group_ids)} entries but rewards has {rewards.shape[0]}")
    adv = record.estimate(rewards, group_ids)
    if tuple(adv.shape) != tuple(rewards.shape):
        raise ValueError(f"advantage estimator {estimator!r} returned shape {tuple(adv.shape)} for "
                         f"{tuple(rewards.shape)} rewards; it must return one advantage per reward")
    return adv


@register_advantage_estimator("grpo", verl_name="grpo",
                              summary="reward minus its group's mean, divided by the group's std")
def _grpo(rewards: Any, group_ids: Sequence[Any]) -> Any:
    return group_advantages(rewards, group_ids, norm_by_std=True)


@register_advantage_estimator("dr_grpo", summary="reward minus its group's mean (Dr. GRPO; verl: grpo with "
                                                "algorithm.norm_adv_by_std_in_grpo=false)")
def _dr_grpo(rewards: Any, group_ids: Sequence[Any]) -> Any:
    return group_advantages(rewards, group_ids, norm_by_std=False)


register_advantage_estimator(
    "rloo", min_group_size=2, why="a sample's baseline is the mean of its group's others", verl_name="rloo",
    summary="reward minus the mean of its group's other rewards",
)(leave_one_out_advantages)


@register_advantage_estimator("gae", needs_critic=True, verl_name="gae",
                              summary="PPO: GAE over the model tokens with a value model (critic.*), whitened")
def _gae(rewards: Any, group_ids: Sequence[Any]) -> Any:
    raise ValueError("adv_estimator 'gae' reads a value model's per-token values, not group rewards: the trainer "
                     "computes it with agentloop_trainer.update.critic.Critic.score (see docs/ppo.md)")
