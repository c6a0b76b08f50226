"""Credit per turn: advantages that differ between the turns of a trajectory
(``algorithm.turn_credit``), from the per-turn rewards of :mod:`agentloop_trainer.update.turns`.

With ``r_t`` the reward of turn ``t`` (they sum to the trajectory's reward ``R``) and
``gamma = algorithm.turn_gamma``, the return of turn ``t`` is ``G_t = r_t + gamma * G_{t+1}``
(``G_t = R`` for every turn with ``gamma=1`` and an outcome-only reward). Modes
(:data:`TURN_CREDIT`):

- ``trajectory``: today's advantage, one per trajectory (``algorithm.adv_estimator`` on ``R``),
  on every token of it. No per-turn information is used.
- ``discounted``: ``A_{i,t} = G_{i,t} - mean_{j != i} G_{j,0}``: each turn's return against the
  whole-episode returns of the group's *other* trajectories (RLOO on returns-to-go).
- ``turn_group`` (MT-GRPO): ``A_{i,t} = G_{i,t} - mean_{j != i, T_j > t} G_{j,t}``: against the
  other trajectories' returns at the same turn index; where no other trajectory reached turn
  ``t``, against their episode returns ``G_{j,0}``.
- ``step_group`` (GiGPO, Feng et al. 2025): ``A_{i,t} = A^E_i + w * A^S_{i,t}`` with ``A^E_i``
  the ``trajectory`` advantage and ``A^S_{i,t} = G_{i,t} - mean G_{j,u}`` over the steps
  ``(j, u)``, ``j != i``, of the same group whose observation (every token the model saw before
  the turn) is identical: GiGPO's anchor states. A step no other trajectory shares gets
  ``A^S = 0``. ``w = algorithm.step_group_weight`` (GiGPO: 1).

**Why leave-one-out.** A baseline keeps the policy gradient unbiased only when it does not
depend on the sample's own actions. The natural per-turn baseline does: normalising turn ``k``
over a group that includes the sample's own return correlates the baseline with its action,
and summing per-turn-normalised rewards over the turns the trajectory itself reached
subtracts a number of baseline terms set by its own stopping turn; verl RFC #7244 shows the
latter's bias equals the group mean of the accumulated intermediate rewards, a hidden bonus
or penalty on every "take another turn" decision. Here every baseline is a mean over the
*other* trajectories only, one baseline per turn (never a sum over the trajectory's own turns);
which others count may depend on the turn's own observation (its turn index, its anchor
state: what the action is conditioned on) but never on its action or what followed, so the
estimator is unbiased whatever the turn counts. With ``algorithm.adv_estimator=grpo`` each
centred return is divided by the std (+1e-6) of the values it was compared with, its own
included (GRPO's scale, equal values giving 0, never a division of a non-zero difference by
~0); ``dr_grpo`` and ``rloo`` leave it undivided. A group of one trajectory has no baseline:
its advantages are 0 (``rollout.n >= 2`` is checked at load).
``tests/test_turn_credit.py`` checks this by exact enumeration on a policy that controls its own
stopping: ``discounted`` and ``turn_group`` give the true policy gradient in expectation, the
naive construction a third of it. ``step_group`` keeps two GiGPO traits: its episode term is the
``trajectory`` advantage (the sample's own reward in the group mean unless
``adv_estimator=rloo``), and its step term acts only on turns whose state another trajectory
shared, so in expectation it adds ``w`` times the gradient of those turns, not of all.

Advantages are per token (``[B, R]``): each token of turn ``t`` gets ``A_{i,t}``; tool and
user tokens and padding get 0 (the loss masks them anyway).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from agentloop_trainer.update.advantages import compute_advantages, trajectory_advantages
from agentloop_trainer.update.finite_rewards import fail_non_finite_rewards
from agentloop_trainer.update.turns import Trajectory, batch_trajectories

__all__ = [
    "TURN_CREDIT",
    "TURN_CREDIT_MODES",
    "CreditSettings",
    "credit_advantages",
    "discounted_returns",
    "per_turn_advantages",
    "token_advantages",
]

EPS = 1e-6
"""Added to the std under ``adv_estimator=grpo``, as :func:`~agentloop_trainer.update.advantages.group_advantages`."""


@dataclass(frozen=True)
class CreditSettings:
    """The ``algorithm`` keys the credit modes read."""

    mode: str = "trajectory"
    """``algorithm.turn_credit``."""
    estimator: str = "grpo"
    """``algorithm.adv_estimator``: ``grpo`` divides centred returns by their std."""
    gamma: float = 1.0
    """``algorithm.turn_gamma``: discount from one turn to the next."""
    step_weight: float = 1.0
    """``algorithm.step_group_weight``: ``w`` of ``step_group``."""

    @classmethod
    def from_config(cls, algorithm: Any) -> CreditSettings:
        """From the ``algorithm`` config section."""
        return cls(algorithm.turn_credit, algorithm.adv_estimator, float(algorithm.turn_gamma),
                   float(algorithm.step_group_weight))


def discounted_returns(rewards: Sequence[float], gamma: float) -> list[float]:
    """``G_t = r_t + gamma * G_{t+1}`` for each turn (``G`` after the last turn is 0)."""
    out, running = [0.0] * len(rewards), 0.0
    for t in range(len(rewards) - 1, -1, -1):
        running = rewards[t] + gamma * running
        out[t] = running
    return out


def _centred(own: float, others: Sequence[float], normalise: bool) -> float:
    """``own`` minus the mean of ``others`` (0 without others), over the std of all of them
    (``own`` included) when ``normalise``."""
    if not others:
        return 0.0
    diff = own - math.fsum(others) / len(others)
    return diff / (statistics.stdev([own, *others]) + EPS) if normalise else diff


def _groups(trajectories: Sequence[Trajectory]) -> dict[Any, list[int]]:
    groups: dict[Any, list[int]] = {}
    for k, traj in enumerate(trajectories):
        groups.setdefault(traj.group, []).append(k)
    return groups


def _episode_return(traj: Trajectory, returns: Sequence[float]) -> float:
    """``G_0``; a trajectory without turns (a failed sample) counts its reward."""
    return returns[0] if returns else traj.reward


PerTurn = Callable[[Sequence[Trajectory], Sequence[Sequence[float]], CreditSettings], list[list[float]]]
"""A credit mode: ``(trajectories, their per-turn returns, settings) -> per-turn advantages``."""


def _trajectory(trajs: Sequence[Trajectory], returns: Sequence[Sequence[float]], s: CreditSettings) -> list[list[float]]:
    adv = compute_advantages(s.estimator, [t.reward for t in trajs], [t.group for t in trajs]).tolist()
    return [[a] * len(t.turns) for a, t in zip(adv, trajs, strict=True)]


def _discounted(trajs: Sequence[Trajectory], returns: Sequence[Sequence[float]], s: CreditSettings) -> list[list[float]]:
    out: list[list[float]] = [[] for _ in trajs]
    norm = s.estimator == "grpo"
    for members in _groups(trajs).values():
        episode = {k: _episode_return(trajs[k], returns[k]) for k in members}
        for i in members:
            others = [episode[j] for j in members if j != i]
            out[i] = [_centred(g, others, norm) for g in returns[i]]
    return out


def _turn_group(trajs: Sequence[Trajectory], returns: Sequence[Sequence[float]], s: CreditSettings) -> list[list[float]]:
    out: list[list[float]] = [[] for _ in trajs]
    norm = s.estimator == "grpo"
    for members in _groups(trajs).values():
        for i in members:
            episode = [_episode_return(trajs[j], returns[j]) for j in members if j != i]
            row = []
            for t, g in enumerate(returns[i]):
                same_turn = [returns[j][t] for j in members if j != i and len(returns[j]) > t]
                row.append(_centred(g, same_turn or episode, norm))
            out[i] = row
    return out


def _step_group(trajs: Sequence[Trajectory], returns: Sequence[Sequence[float]], s: CreditSettings) -> list[list[float]]:
    episode = _trajectory(trajs, returns, s)
    norm = s.estimator == "grpo"
    anchors: dict[tuple[Any, bytes], list[tuple[int, int]]] = {}
    for i, traj in enumerate(trajs):
        for t, span in enumerate(traj.turns):
            anchors.setdefault((traj.group, span.observation), []).append((i, t))
    out = [list(row) for row in episode]
    for steps in anchors.values():
        for i, t in steps:
            others = [returns[j][u] for j, u in steps if j != i]
            out[i][t] += s.step_weight * _centred(returns[i][t], others, norm)
    return out


TURN_CREDIT: dict[str, PerTurn] = {
    "trajectory": _trajectory,
    "discounted": _discounted,
    "turn_group": _turn_group,
    "step_group": _step_group,
}
"""``algorithm.turn_credit`` -> the mode (see the module docstring). A new mode is one function
of this signature added here (and its line in ``AlgorithmSection.turn_credit``)."""
TURN_CREDIT_MODES: tuple[str, ...] = tuple(TURN_CREDIT)
"""Values of ``algorithm.turn_credit``."""


def per_turn_advantages(trajectories: Sequence[Trajectory], settings: CreditSettings) -> list[list[float]]:
    """One advantage per turn of each trajectory, by ``settings.mode``.

    Raises:
        ValueError: on an unknown mode, listing the valid ones.
    """
    mode = TURN_CREDIT.get(settings.mode)
    if mode is None:
        raise ValueError(f"unknown algorithm.turn_credit {settings.mode!r}; valid: {', '.join(TURN_CREDIT_MODES)} "
                         "(a new mode is a function added to agentloop_trainer.update.turn_credit.TURN_CREDIT)")
    returns = [discounted_returns(t.rewards, settings.gamma) for t in trajectories]
    return mode(trajectories, returns, settings)


def token_advantages(shape: tuple[int, int], trajectories: Sequence[Trajectory],
                     advantages: Sequence[Sequence[float]]) -> Any:
    """``[B, R]`` float32: each turn's advantage on its tokens, 0 elsewhere."""
    import torch

    out = torch.zeros(shape, dtype=torch.float32)
    for traj, row in zip(trajectories, advantages, strict=True):
        for span, a in zip(traj.turns, row, strict=True):
            out[span.row, span.start:span.end] = a
    return out


def credit_advantages(settings: CreditSettings, batch: Any, group_ids: Sequence[Any]) -> Any:
    """The advantages of a rollout batch for the actor's update.

    Args:
        settings: Mode, estimator, discount, step weight.
        batch: A :class:`~agentloop_core.batch.RolloutBatch` (rows may be segments).
        group_ids: ``B`` per-row group ids.

    Returns:
        ``trajectory``: ``[B]`` per-row advantages, exactly
        :func:`~agentloop_trainer.update.advantages.trajectory_advantages`; the other modes
        ``[B, R]`` per-token advantages.

    A trajectory whose reward (or a per-turn reward) is not finite in float32 is first marked
    failed in ``batch`` (:func:`~agentloop_trainer.update.finite_rewards.fail_non_finite_rewards`),
    so it cannot turn its group's advantages into NaN.

    Raises:
        ValueError: an unknown mode, or per-turn rewards that do not match a trajectory's turns.
    """
    import torch

    fail_non_finite_rewards(batch)
    if settings.mode == "trajectory":  # the [B] path of every run before per-turn credit, bit for bit
        trajectories = batch.trajectory_index.tolist()
        return trajectory_advantages(settings.estimator, torch.as_tensor(batch.rewards), list(group_ids), trajectories)
    trajs = batch_trajectories(batch, group_ids, observations=settings.mode == "step_group")
    return token_advantages(tuple(batch.response_mask.shape), trajs, per_turn_advantages(trajs, settings))
