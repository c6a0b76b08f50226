"""Policy losses: the PPO-clip policy loss over ``response_mask`` (token ratios, or GSPO's
sequence ratio), its aggregation modes, the k3 KL estimator, and the truncated importance weight
that corrects for the gap between the engine's (rollout) log-probs and the trainer's.

The policy losses are a table (:data:`POLICY_LOSSES`, name -> :class:`PolicyLoss`):
``actor_rollout_ref.actor.policy_loss.loss_mode`` is a name in it; a new one is one
:func:`register_policy_loss` here.

Every function takes torch tensors shaped ``[B]`` (per row) or ``[B, R]`` (per response
token) and never looks at padding: ``response_mask`` decides which tokens count.

A row is one segment of a trajectory (one row per sample unless its loop split the trajectory,
see ``agentloop_core.segments``). The loss counts a trajectory once, however many rows it
spans: ``token-mean`` weights every generated token once, wherever it sits, and the
``seq-mean`` modes take the trajectory, not the row, as the sequence (:func:`sequence_weights`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

from agentloop_trainer.update.tables import AlgorithmTable

LossAggMode = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"]
LOSS_AGG_MODES: tuple[str, ...] = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")
"""Values of ``actor_rollout_ref.actor.loss_agg_mode``."""


class PolicyTerms(NamedTuple):
    """What a policy loss gives :func:`ppo_clip_loss` for a batch."""

    per_token: Any
    """``[B, R]`` the loss of each token, before the importance weight and the aggregation."""
    ratio: Any
    """``[B, R]`` the importance ratio it used (``actor/ratio_mean``)."""
    clipped: Any
    """``[B, R]`` bool: the tokens whose term is clipped (``actor/pg_clipfrac``)."""


PerToken = Callable[..., PolicyTerms]
"""``(log_probs, old_log_probs, advantages, response_mask, *, clip_ratio_low, clip_ratio_high)
-> PolicyTerms``; ``advantages`` is ``[B, R]``, ``response_mask`` float."""


@dataclass(frozen=True)
class PolicyLoss:
    """One row of :data:`POLICY_LOSSES`: the per-token loss and what it is."""

    name: str
    """The value of ``actor_rollout_ref.actor.policy_loss.loss_mode`` (verl's names)."""
    per_token: PerToken
    """The per-token terms (see :data:`PerToken`)."""
    level: Literal["token", "sequence"]
    """What one ratio belongs to: each token, or its whole sequence (clipping keeps or drops it)."""
    verl_name: str | None = None
    """verl's name for the same loss (None: verl has none)."""
    pairs_with: str = ""
    """The settings it is meant with (for docs and the config docstring)."""


POLICY_LOSSES: AlgorithmTable[PolicyLoss] = AlgorithmTable(
    "policy_loss.loss_mode", "agentloop.policy_losses", PolicyLoss,
    "Register one with agentloop_trainer.update.losses.register_policy_loss, in code or from the module an "
    "entry point of 'agentloop.policy_losses' names.",
)
"""Values of ``actor_rollout_ref.actor.policy_loss.loss_mode``: name -> :class:`PolicyLoss`."""


def register_policy_loss(name: str, *, level: Literal["token", "sequence"], verl_name: str | None = None,
                         pairs_with: str = "") -> Callable[[PerToken], PerToken]:
    """Decorator: add the per-token loss to :data:`POLICY_LOSSES` under ``name``.

    Raises:
        ValueError: another loss holds the name.
    """
    def register(per_token: PerToken) -> PerToken:
        POLICY_LOSSES.add(name, PolicyLoss(name, per_token, level, verl_name, pairs_with))
        return per_token

    return register


def masked_mean(values: Any, mask: Any) -> Any:
    """Mean of ``values`` where ``mask`` is 1 (0 when the mask is empty)."""
    mask = mask.to(values.dtype)
    return (values * mask).sum() / mask.sum().clamp(min=1.0)


def sequence_weights(response_mask: Any, trajectory_ids: Sequence[Any]) -> Any:
    """``[B]`` the share of its trajectory's generated tokens each row holds: 1 for the row of
    a one-row trajectory, 0 for a row with no generated tokens. The ``seq-mean`` modes of
    :func:`aggregate_loss` count a row as this fraction of a sequence, so a trajectory split
    into segments counts as one sequence, like one that was not."""
    import torch

    tokens = response_mask.to(torch.float32).sum(-1)
    if len(trajectory_ids) != tokens.shape[0]:
        raise ValueError(f"trajectory_ids has {len(trajectory_ids)} entries but response_mask has {tokens.shape[0]} rows")
    number: dict[Any, int] = {}
    inverse = torch.tensor([number.setdefault(t, len(number)) for t in trajectory_ids], dtype=torch.long)
    total = torch.zeros(len(number)).index_add_(0, inverse, tokens)[inverse]
    return torch.where(total > 0, tokens / total.clamp(min=1.0), torch.zeros_like(tokens))


def aggregate_loss(per_token: Any, mask: Any, mode: str = "token-mean", seq_weight: Any = None) -> Any:
    """Reduce a ``[B, R]`` per-token loss to a scalar over masked tokens.

    ``token-mean`` weights every generated token equally (long responses count more);
    ``seq-mean-token-mean`` averages per sequence first; ``seq-mean-token-sum`` sums tokens
    per sequence then averages sequences.

    Args:
        per_token: ``[B, R]`` loss per token.
        mask: ``[B, R]`` 1 on the tokens that count.
        mode: The aggregation.
        seq_weight: ``[B]`` for the ``seq-mean`` modes: the fraction of a sequence each row
            is (:func:`sequence_weights`; a row of a trajectory split into segments is part
            of one sequence). None: every row with tokens is a whole sequence.

    Raises:
        ValueError: on an unknown mode.
    """
    import torch

    mask = mask.to(per_token.dtype)
    if mode == "token-mean":
        return masked_mean(per_token, mask)
    per_seq_tokens = (per_token * mask).sum(-1)
    if seq_weight is None:
        weight = (mask.sum(-1) > 0).to(per_token.dtype)
        denominator = weight.sum().clamp(min=1.0)
    else:
        weight = seq_weight.to(per_token.dtype)
        total = weight.sum()
        # A mini-batch may hold a fraction of a trajectory: never round its count up to 1.
        denominator = torch.where(total > 0, total, torch.ones_like(total))
    if mode == "seq-mean-token-mean":
        # weight = row tokens / trajectory tokens: each row adds its tokens' share of the mean.
        per_seq = per_seq_tokens / mask.sum(-1).clamp(min=1.0) * weight
    elif mode == "seq-mean-token-sum":
        # A trajectory's token sum is the sum over its rows, whatever their shares.
        per_seq = per_seq_tokens * (weight > 0).to(per_token.dtype)
    else:
        raise ValueError(f"unknown loss_agg_mode {mode!r}; valid: {', '.join(LOSS_AGG_MODES)}")
    return per_seq.sum() / denominator


def kl_k3(log_probs: Any, ref_log_probs: Any, clamp: float | None = 10.0) -> Any:
    """Per-token k3 estimate of KL(policy || reference): ``exp(d) - d - 1`` with
    ``d = ref - logp``; non-negative, unbiased, low variance. Clamped to ``[-clamp, clamp]`` in
    ``d`` (10 for the KL loss, so one outlier token cannot blow up the loss; None: not clamped,
    as on-policy distillation's ``k3``, which has its own ``loss_max_clamp``)."""
    import torch

    d = ref_log_probs - log_probs
    if clamp is not None:
        d = torch.clamp(d, -clamp, clamp)
    # expm1: exact for small d, where exp(d) - 1 would lose the d**2 / 2 left to float32 rounding.
    return torch.expm1(d) - d


def truncated_importance_weight(old_log_probs: Any, rollout_log_probs: Any, cap: float) -> Any:
    """``min(pi_old / pi_rollout, cap)`` per token, detached.

    The engine samples with its own kernels (and possibly precision), so its log-probs differ
    from the trainer's recomputation on the same weights; weighting the loss by this capped
    ratio keeps the gradient an estimate for the trainer's policy without letting a few
    mismatched tokens dominate.
    """
    import torch

    return torch.exp(torch.clamp(old_log_probs - rollout_log_probs, max=20.0)).clamp(max=cap).detach()


def gspo_log_ratio(log_probs: Any, old_log_probs: Any, response_mask: Any) -> Any:
    """``[B, R]`` log of GSPO's per-token ratio ``s_i,t = sg[s_i] * pi(y_t) / sg[pi(y_t)]``.

    ``s_i = exp(mean over row i's masked tokens of (logp - old))`` is the sequence's
    length-normalised importance ratio (GSPO, arXiv 2507.18071); every token of the row gets
    its value, so clipping keeps or drops a whole sequence. The stop-gradient construction
    makes the value ``s_i`` while each token's gradient is ``s_i * grad log pi(y_t)``: the
    gradient of ``s_i`` itself, spread over the tokens. Clamped at 10 (``s_i <= e^10``).
    """
    import torch

    mask = response_mask.to(log_probs.dtype)
    token = torch.clamp(log_probs - old_log_probs, -20.0, 20.0) * mask
    per_seq = token.sum(-1) / mask.sum(-1).clamp(min=1.0)
    return torch.clamp(log_probs - log_probs.detach() + per_seq.detach().unsqueeze(-1), max=10.0)


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
    seq_weight: Any = None,
    loss_mode: str = "vanilla",
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
        seq_weight: Optional ``[B]`` fraction of a sequence each row is, for the ``seq-mean``
            modes (see :func:`aggregate_loss`).
        loss_mode: A name in :data:`POLICY_LOSSES`: ``vanilla`` (each token's ratio) or ``gspo``
            (its row's sequence ratio, :func:`gspo_log_ratio`; GSPO's clip ranges are small,
            ~3e-4 / 4e-4). The loss is
            aggregated by ``loss_agg_mode`` either way: ``seq-mean-token-mean`` is the GSPO
            paper's objective (each sequence once), ``token-mean`` weights a sequence by its
            tokens.

    Returns:
        The scalar loss and metrics (``actor/pg_clipfrac``: the fraction of tokens whose
        term is clipped, with ``gspo`` that of whole sequences weighted by their tokens;
        ``actor/ppo_kl``, ``actor/ratio_mean``).

    Raises:
        ValueError: on an unknown ``loss_mode``.
    """
    import torch

    policy = POLICY_LOSSES.get(loss_mode)
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(-1).expand_as(log_probs)
    mask = response_mask.to(log_probs.dtype)
    log_ratio = torch.clamp(log_probs - old_log_probs, -20.0, 20.0)
    per_token, ratio, clipped = policy.per_token(log_probs, old_log_probs, advantages, mask,
                                                 clip_ratio_low=clip_ratio_low, clip_ratio_high=clip_ratio_high)
    if importance_weight is not None:
        per_token = per_token * importance_weight
    loss = aggregate_loss(per_token, mask, loss_agg_mode, seq_weight)
    with torch.no_grad():
        metrics = {
            "actor/pg_clipfrac": float(masked_mean(clipped.to(mask.dtype), mask)),
            "actor/ppo_kl": float(masked_mean(-log_ratio, mask)),
            "actor/ratio_mean": float(masked_mean(ratio, mask)),
        }
    return loss, metrics


def clipped_surrogate(log_ratio: Any, advantages: Any, clip_ratio_low: float, clip_ratio_high: float) -> PolicyTerms:
    """PPO's clipped surrogate on ``exp(log_ratio)``: per token ``max(-A r, -A clip(r))``."""
    import torch

    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    return PolicyTerms(torch.maximum(unclipped, clipped), ratio, clipped > unclipped)


@register_policy_loss("vanilla", level="token", verl_name="vanilla")
def _vanilla(log_probs: Any, old_log_probs: Any, advantages: Any, response_mask: Any, *,
             clip_ratio_low: float, clip_ratio_high: float) -> PolicyTerms:
    """PPO-clip on each token's ratio."""
    import torch

    log_ratio = torch.clamp(log_probs - old_log_probs, -20.0, 20.0)
    return clipped_surrogate(log_ratio, advantages, clip_ratio_low, clip_ratio_high)


@register_policy_loss("gspo", level="sequence", verl_name="gspo",
                      pairs_with="clip_ratio_low=0.0003 clip_ratio_high=0.0004 loss_agg_mode=seq-mean-token-mean")
def _gspo(log_probs: Any, old_log_probs: Any, advantages: Any, response_mask: Any, *,
          clip_ratio_low: float, clip_ratio_high: float) -> PolicyTerms:
    """PPO-clip on each row's sequence ratio (:func:`gspo_log_ratio`)."""
    return clipped_surrogate(gspo_log_ratio(log_probs, old_log_probs, response_mask), advantages,
                             clip_ratio_low, clip_ratio_high)
