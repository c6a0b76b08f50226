"""Token log-probs under the placeholder ban, the convention every engine samples and reports by.

A vision-language model's image and video placeholder ids are banned from sampling in every
engine (:mod:`agentloop_engines.adapters.placeholders`), and every engine returns the sampled token's
log-prob under that banned distribution: ``log_softmax`` of the logits with the placeholder
columns at ``-inf``. The trainer scores generated tokens the same way, through
:func:`token_log_probs`, so rollout, old, new and reference log-probs are of one distribution.

Placeholder tokens are themselves targets in a prompt and in tool results (each image's run);
their log-prob under the ban is ``-inf``, and although ``response_mask`` is 0 there,
``-inf * 0`` is NaN in the loss and its gradients. So a target that is a banned id scores 0.
Text-only models ban nothing: the full-vocabulary computation, a few rows at a time
(:mod:`~agentloop_trainer.update.picked_log_probs`), at no extra cost. The banned path still casts
the scored logits to float32 whole.
"""

from __future__ import annotations

from typing import Any

from agentloop_engines.adapters.placeholders import placeholder_token_ids
from agentloop_trainer.update.picked_log_probs import picked_log_probs

__all__ = ["banned_token_ids", "token_log_probs"]


def banned_token_ids(model: Any) -> tuple[int, ...]:
    """The placeholder ids ``model`` (plain, peft- or FSDP-wrapped: read from its ``config``)
    never samples; ``()`` for a text-only model."""
    return placeholder_token_ids(getattr(model, "config", None))


def token_log_probs(logits: Any, targets: Any, banned: tuple[int, ...] = (), temperature: float = 1.0) -> Any:
    """``log p(targets)`` under ``log_softmax(logits / temperature)`` with the ``banned`` columns
    removed, in float32.

    Args:
        logits: ``[B, L, V]`` or ``[L, V]`` logits of any float dtype.
        targets: ``[B, n]`` or ``[n]`` long ids, ``n <= L``: position ``j`` scores
            ``targets[..., j]``; positions ``n..L-1`` (a causal model's last) are not scored.
        banned: Ids removed from the distribution (:func:`banned_token_ids`); ids outside
            ``[0, V)`` are ignored. Empty: the full-vocabulary log-prob, a few rows at a time
            (:func:`~agentloop_trainer.update.picked_log_probs.picked_log_probs`).
        temperature: The sampling temperature (None or 0 read as 1).

    Returns:
        ``[B, n]`` or ``[n]`` log-probs, finite everywhere: a target that is a banned id gets 0
        (the caller masks those positions out: placeholders are never generated).
    """
    import torch

    temperature = float(temperature or 1.0)
    cols = [t for t in banned if t < logits.shape[-1]]
    if not cols:
        return picked_log_probs(logits, targets, temperature)
    logits = logits[..., : targets.shape[-1], :].float()
    if temperature != 1.0:
        logits = logits / temperature
    index = torch.tensor(cols, device=logits.device)
    allowed = logits.index_fill(-1, index, float("-inf"))  # out of place: the caller's logits stay intact
    picked = allowed.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(allowed, dim=-1)
    return picked.masked_fill(torch.isin(targets, index), 0.0)
