"""PPO's pieces that need a value model: token rewards, GAE, whitening, the clipped value loss.

``algorithm.adv_estimator=gae`` computes, per row over its response tokens,
``delta_t = r_t + gamma * V_{next(t)} - V_t`` and ``A_t = delta_t + gamma * lam * A_{next(t)}``,
``returns = A + V`` (the critic's target), then whitens ``A`` over every model token of the
batch (verl's ``compute_gae_advantage_return`` and ``masked_whiten``).

**Multi-turn.** Tool results and user turns sit inside the response with ``response_mask`` 0:
they are observations, not actions. Following verl, such a token neither gets an advantage of
its own nor breaks the recursion: ``next(t)`` is the next *model* token, so the last model token
of one turn bootstraps from the value at the first model token of the next turn, and gamma/lam
discount once per model token (the observation tokens between cost nothing). The outcome reward
sits on the last model token of the trajectory (:func:`token_level_rewards`); a failed sample
(mask all 0) gets advantages and returns 0 and counts nowhere.
"""

from __future__ import annotations

from typing import Any, NamedTuple

__all__ = [
    "ValueLoss",
    "clipped_value_loss",
    "compute_gae_advantage_return",
    "explained_variance",
    "masked_whiten",
    "token_level_rewards",
]


def token_level_rewards(rewards: Any, response_mask: Any) -> Any:
    """``[B, R]`` rewards with each row's scalar reward on its last model token (0 elsewhere).

    Args:
        rewards: ``[B]`` outcome rewards, one per row.
        response_mask: ``[B, R]`` 1 on model tokens, 0 on tool/user tokens and padding.

    Returns:
        ``[B, R]`` float32; a row with no model token (a failed sample) is all 0.
    """
    import torch

    mask = torch.as_tensor(response_mask, dtype=torch.float32)
    rewards = torch.as_tensor(rewards, dtype=torch.float32).to(mask.device)
    if rewards.shape != mask.shape[:1]:
        raise ValueError(f"rewards has shape {tuple(rewards.shape)} but response_mask has {mask.shape[0]} rows; "
                         "give one reward per row")
    positions = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
    last = torch.where(mask > 0, positions, torch.full_like(positions, -1)).max(dim=1).values
    out = torch.zeros_like(mask)
    has = last >= 0
    out[has.nonzero().squeeze(1), last[has]] = rewards[has]
    return out


def masked_mean(values: Any, mask: Any) -> Any:
    """Mean of ``values`` where ``mask`` is 1 (0 when the mask is empty)."""
    return (values * mask).sum() / mask.sum().clamp(min=1.0)


def masked_whiten(values: Any, mask: Any, eps: float = 1e-8) -> Any:
    """``(values - mean) / sqrt(var + eps)`` with mean and unbiased variance over ``mask``
    (verl's ``masked_whiten``); positions outside the mask are set to 0. Fewer than two masked
    values: centred only (no spread to divide by)."""
    import torch

    mask = mask.to(values.dtype)
    n = mask.sum()
    mean = masked_mean(values, mask)
    centred = values - mean
    if n < 2:
        return centred * mask
    var = (centred.pow(2) * mask).sum() / (n - 1)
    return centred * torch.rsqrt(var + eps) * mask


def compute_gae_advantage_return(token_rewards: Any, values: Any, response_mask: Any, gamma: float,
                                 lam: float, *, whiten: bool = True) -> tuple[Any, Any]:
    """GAE advantages and returns over the response tokens (see the module docstring).

    Args:
        token_rewards: ``[B, R]`` per-token rewards (:func:`token_level_rewards`).
        values: ``[B, R]`` the critic's values; ``values[:, t]`` is the value of the state
            before response token ``t``.
        response_mask: ``[B, R]`` 1 on model tokens (actions), 0 on observations and padding.
        gamma: Discount per model token.
        lam: GAE's lambda.
        whiten: Whiten the advantages over the batch's model tokens (verl does).

    Returns:
        ``(advantages, returns)``, both ``[B, R]`` float32 and 0 outside the mask; ``returns``
        are ``A + V`` before whitening (the critic's target).
    """
    import torch

    mask = torch.as_tensor(response_mask, dtype=torch.float32)
    rewards = torch.as_tensor(token_rewards, dtype=torch.float32).to(mask.device)
    values = torch.as_tensor(values, dtype=torch.float32).to(mask.device).detach()
    if not rewards.shape == values.shape == mask.shape:
        raise ValueError(f"token_rewards {tuple(rewards.shape)}, values {tuple(values.shape)} and response_mask "
                         f"{tuple(mask.shape)} must have one shape [B, R]")
    B, R = mask.shape
    next_value = torch.zeros(B, device=mask.device)
    last_gae = torch.zeros(B, device=mask.device)
    advantages = torch.zeros_like(mask)
    for t in reversed(range(R)):
        m = mask[:, t]
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        gae = delta + gamma * lam * last_gae
        # An observation token carries the next model token's value and advantage back unchanged.
        next_value = values[:, t] * m + (1 - m) * next_value
        last_gae = gae * m + (1 - m) * last_gae
        advantages[:, t] = last_gae
    returns = (advantages + values) * mask
    advantages = masked_whiten(advantages, mask) if whiten else advantages * mask
    return advantages, returns


class ValueLoss(NamedTuple):
    """The critic's loss on one micro-batch and what it measured."""

    loss: Any
    """Scalar: ``0.5 * sum(max(l_unclipped, l_clipped)) / normaliser``."""
    clipped_tokens: float
    """Tokens where the clipped squared error was the larger (the clip acted)."""


def clipped_value_loss(values: Any, old_values: Any, returns: Any, response_mask: Any, cliprange_value: float,
                       normaliser: float | None = None) -> ValueLoss:
    """PPO's clipped value loss (verl's ``compute_value_loss``): the new value may move at most
    ``cliprange_value`` from ``old_values`` before the squared error counts it;
    ``0.5 * max((V - G)^2, (clip(V, V_old - c, V_old + c) - G)^2)``, token-mean over the mask.

    Args:
        values: ``[b, R]`` the critic's current values (with grad).
        old_values: ``[b, R]`` the values the batch was scored with.
        returns: ``[b, R]`` the GAE returns.
        response_mask: ``[b, R]`` 1 on model tokens.
        cliprange_value: The clip range.
        normaliser: Divide the summed loss by this (a mini-batch's token count, when this is one
            micro-batch of it); None: the mask's own token count.

    Returns:
        The loss and the number of tokens the clip acted on.
    """
    import torch

    mask = response_mask.to(values.dtype)
    moved = values - old_values
    # Inside the range the clipped value is V itself: old + (V - old) can round to a neighbouring
    # float when V and V_old differ in magnitude, and the clip fraction would count that rounding.
    clipped = torch.where(moved.abs() > cliprange_value,
                          old_values + moved.clamp(-cliprange_value, cliprange_value), values)
    unclipped_loss = (values - returns).pow(2)
    clipped_loss = (clipped - returns).pow(2)
    per_token = torch.maximum(unclipped_loss, clipped_loss)
    n = float(mask.sum()) if normaliser is None else normaliser
    loss = 0.5 * (per_token * mask).sum() / max(n, 1e-9)
    return ValueLoss(loss, float(((clipped_loss > unclipped_loss).float() * mask).sum()))


def explained_variance(values: Any, returns: Any, response_mask: Any) -> float:
    """``1 - Var(returns - values) / (Var(returns) + 1e-5)`` over the mask (verl's
    ``critic/vf_explained_var``): 1 for a perfect critic, 0 for one that predicts the mean,
    negative for a worse one; the 1e-5 keeps it finite when the returns do not vary."""
    mask = response_mask.to(values.dtype)
    n = mask.sum()
    if n < 2:
        return 0.0

    def var(x: Any) -> Any:
        return ((x - masked_mean(x, mask)).pow(2) * mask).sum() / (n - 1)

    return float(1.0 - var(returns - values) / (var(returns) + 1e-5))
