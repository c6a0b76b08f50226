"""GRPO math: group-normalised advantages, the PPO-clip policy loss over ``response_mask``,
the k3 KL estimator, and the truncated importance weight that corrects for the gap between
the engine's (rollout) log-probs and the trainer's.

Every function takes torch tensors shaped ``[B]`` (per sample) or ``[B, R]`` (per response
token) and never looks at padding: ``response_mask`` decides which tokens count.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

LossAggMode = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"]
LOSS_AGG_MODES: tuple[str, ...] = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")
ADV_ESTIMATORS: tuple[str, ...] = ("grpo", "dr_grpo")


def masked_mean(values: Any, mask: Any) -> Any:
    """Mean of ``values`` where ``mask`` is 1 (0 when the mask is empty)."""
    mask = mask.to(values.dtype)
    return (values * mask).sum() / mask.sum().clamp(min=1.0)


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


def compute_advantages(estimator: str, rewards: Any, group_ids: Sequence[Any]) -> Any:
    """Advantages by estimator name (``grpo`` or ``dr_grpo``).

    Raises:
        ValueError: on an unknown estimator, listing the valid ones.
    """
    if estimator not in ADV_ESTIMATORS:
        raise ValueError(f"unknown adv_estimator {estimator!r}; valid: {', '.join(ADV_ESTIMATORS)}")
    return group_advantages(rewards, group_ids, norm_by_std=estimator == "grpo")


def aggregate_loss(per_token: Any, mask: Any, mode: str = "token-mean") -> Any:
    """Reduce a ``[B, R]`` per-token loss to a scalar over masked tokens.

    ``token-mean`` weights every generated token equally (long responses count more);
    ``seq-mean-token-mean`` averages per sequence first; ``seq-mean-token-sum`` sums tokens
    per sequence then averages sequences.

    Raises:
        ValueError: on an unknown mode.
    """
    mask = mask.to(per_token.dtype)
    if mode == "token-mean":
        return masked_mean(per_token, mask)
    per_seq_tokens = (per_token * mask).sum(-1)
    has_tokens = (mask.sum(-1) > 0).to(per_token.dtype)
    if mode == "seq-mean-token-mean":
        per_seq = per_seq_tokens / mask.sum(-1).clamp(min=1.0)
    elif mode == "seq-mean-token-sum":
        per_seq = per_seq_tokens
    else:
        raise ValueError(f"unknown loss_agg_mode {mode!r}; valid: {', '.join(LOSS_AGG_MODES)}")
    return (per_seq * has_tokens).sum() / has_tokens.sum().clamp(min=1.0)


def kl_k3(log_probs: Any, ref_log_probs: Any) -> Any:
    """Per-token k3 estimate of KL(policy || reference): ``exp(d) - d - 1`` with
    ``d = ref - logp``; non-negative, unbiased, low variance. Clamped to [-10, 10] in ``d``
    so one outlier token cannot blow up the loss."""
    import torch

    d = torch.clamp(ref_log_probs - log_probs, -10.0, 10.0)
    return torch.exp(d) - d - 1.0


def truncated_importance_weight(old_log_probs: Any, rollout_log_probs: Any, cap: float) -> Any:
    """``min(pi_old / pi_rollout, cap)`` per token, detached.

    The engine samples with its own kernels (and possibly precision), so its log-probs differ
    from the trainer's recomputation on the same weights; weighting the loss by this capped
    ratio keeps the gradient an estimate for the trainer's policy without letting a few
    mismatched tokens dominate.
    """
    import torch

    return torch.exp(torch.clamp(old_log_probs - rollout_log_probs, max=20.0)).clamp(max=cap).detach()


def ppo_clip_loss(
    log_probs: Any,
    old_log_probs: Any,
    advantages: Any,
    response_mask: Any,
    *,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    loss_agg_mode: str = "token-mean",
    importance_weight: Any = None,
) -> tuple[Any, dict[str, float]]:
    """PPO clipped surrogate loss over generated tokens.

    Args:
        log_probs: ``[B, R]`` current policy log-probs (with grad).
        old_log_probs: ``[B, R]`` log-probs of the policy that produced the batch (no grad).
        advantages: ``[B]`` per-sample or ``[B, R]`` per-token advantages.
        response_mask: ``[B, R]`` 1 for generated tokens; others get no loss and no gradient.
        clip_ratio_low: Ratio floor is ``1 - clip_ratio_low``.
        clip_ratio_high: Ratio ceiling is ``1 + clip_ratio_high``.
        loss_agg_mode: See :func:`aggregate_loss`.
        importance_weight: Optional ``[B, R]`` detached per-token weight (see
            :func:`truncated_importance_weight`).

    Returns:
        The scalar loss and metrics (``actor/pg_clipfrac``, ``actor/ppo_kl``, ``actor/ratio_mean``).
    """
    import torch

    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(-1).expand_as(log_probs)
    mask = response_mask.to(log_probs.dtype)
    log_ratio = torch.clamp(log_probs - old_log_probs, -20.0, 20.0)
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    per_token = torch.maximum(unclipped, clipped)
    if importance_weight is not None:
        per_token = per_token * importance_weight
    loss = aggregate_loss(per_token, mask, loss_agg_mode)
    with torch.no_grad():
        metrics = {
            "actor/pg_clipfrac": float(masked_mean((clipped > unclipped).to(mask.dtype), mask)),
            "actor/ppo_kl": float(masked_mean(-log_ratio, mask)),
            "actor/ratio_mean": float(masked_mean(ratio, mask)),
        }
    return loss, metrics
