"""The SFT loss and one optimizer step; shared by the general SFT stage and the tiny model's
warm-up (their learning-rate schedules: :mod:`~agentloop_trainer.policy.lr_schedules`)."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Sequence
from typing import Any

from agentloop_trainer.stages.sft.tokenize import TokenizedConversation
from agentloop_trainer.update.forward import MIN_SHARED_PREFIX, common_prefix_length
from agentloop_trainer.update.step_prefix import StepPrefix


def sft_loss(model: Any, examples: Sequence[TokenizedConversation], normalizer: float | None = None,
             share_prefix: bool = True, prefix: StepPrefix | None = None) -> Any:
    """Negative log-likelihood of the tokens whose loss mask is 1, summed and divided by
    ``normalizer`` (None: their number in ``examples``, i.e. the token mean).

    The rows' shared prompt prefix (system turn and tool schemas) is computed once, see
    :func:`agentloop_trainer.update.forward.sequence_log_probs`.

    Args:
        model: A causal LM.
        examples: Tokenized conversations.
        normalizer: Trained tokens of the whole batch when ``examples`` is one micro-batch of it,
            so the micro-batches' losses add up to the batch's token mean.
        share_prefix: Compute the common prefix once (off under gradient checkpointing, as in
            the GRPO actor).
        prefix: The step's shared prefix, already run (:func:`step_prefix`): the rows run on
            its cache alone.
    """
    import torch

    from agentloop_trainer.update.forward import sequence_log_probs
    from agentloop_trainer.update.vision_forward import multimodal_log_probs

    first = min((e.loss_mask.index(1) for e in examples if 1 in e.loss_mask), default=1)
    if any(e.images for e in examples):
        # Image tokens take the vision tower's embeddings: one forward with the pixel values.
        logp = multimodal_log_probs(model, [e.input_ids for e in examples], [e.images for e in examples])
    else:
        logp = sequence_log_probs(model, [e.input_ids for e in examples], first_scored=first,
                                  share_prefix=share_prefix, prefix=prefix)
    n = logp.shape[1] + 1
    weight = torch.zeros((len(examples), n), dtype=logp.dtype, device=logp.device)
    for row, e in enumerate(examples):
        weight[row, : len(e.loss_mask)] = torch.as_tensor(e.loss_mask, dtype=logp.dtype)
    weight = weight[:, 1:]
    total = -(logp * weight).sum()
    return total / (weight.sum().clamp(min=1.0) if normalizer is None else max(float(normalizer), 1.0))


def step_prefix(model: Any, examples: Sequence[TokenizedConversation]) -> StepPrefix | None:
    """The prefix every conversation of a step shares, up to the first trained token, run once
    for all its micro-batches; None where that does not pay (under ``MIN_SHARED_PREFIX``
    tokens), where an image is in a conversation, or where this transformers' cache cannot
    be shared (:meth:`StepPrefix.build`)."""
    if any(e.images for e in examples) or not any(1 in e.loss_mask for e in examples):
        return None
    first = min(e.loss_mask.index(1) for e in examples if 1 in e.loss_mask)
    ids = [e.input_ids for e in examples]
    # Nothing scored inside it (position first - 1 predicts the first trained token), and
    # every row keeps a token of its own.
    length = min(common_prefix_length(ids), first - 1, min(len(i) for i in ids) - 1)
    return StepPrefix.build(model, ids[0][:length]) if length >= MIN_SHARED_PREFIX else None


def make_optimizer(model: Any, lr: float, weight_decay: float = 0.0) -> Any:
    """AdamW over the trainable parameters (the adapters under LoRA), betas (0.9, 0.95)."""
    import torch

    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, betas=(0.9, 0.95))


def sft_step(model: Any, optimizer: Any, examples: Sequence[TokenizedConversation], lr: float, *,
             micro_batch_size: int | None = None, grad_clip: float = 1.0, compute_dtype: str | None = None,
             share_prefix: bool = True) -> dict[str, float]:
    """One optimizer step on ``examples`` (the token mean of their loss).

    Args:
        model: The policy, in train mode.
        optimizer: Its optimizer (:func:`make_optimizer`).
        examples: The batch.
        lr: Learning rate of this step.
        micro_batch_size: Conversations per forward/backward (gradients accumulate over the
            batch); None: the whole batch at once.
        grad_clip: Max global gradient norm.
        compute_dtype: ``bfloat16``: forward under ``torch.autocast`` (master weights and
            optimizer state stay float32); None or ``float32``: no autocast.
        share_prefix: See :func:`sft_loss`; with several micro-batches the prefix all of them
            share runs once for the step (:func:`step_prefix`).

    Returns:
        ``loss`` (the batch's token mean), ``grad_norm`` (before clipping), ``tokens`` (all ids)
        and ``trained_tokens``.
    """
    import torch

    for group in optimizer.param_groups:
        group["lr"] = lr
    size = micro_batch_size or len(examples)
    chunks = [examples[k : k + size] for k in range(0, len(examples), size)]
    # One chunk: the loss divides by its own token count, exactly as before micro-batching existed.
    normalizer = None if len(chunks) == 1 else float(sum(e.trained_tokens for e in examples))
    device = next(model.parameters()).device
    cast = (torch.autocast(device.type, dtype=getattr(torch, compute_dtype))
            if compute_dtype and compute_dtype != "float32" else contextlib.nullcontext())
    total = 0.0
    optimizer.zero_grad(set_to_none=True)
    prefix = None
    if share_prefix and len(chunks) > 1:
        with cast:
            prefix = step_prefix(model, examples)
    for chunk in chunks:
        with cast:
            loss = sft_loss(model, chunk, normalizer=normalizer, share_prefix=share_prefix, prefix=prefix)
        loss.backward()
        total += float(loss.detach())
    if prefix is not None:
        prefix.backward()
    params = [p for group in optimizer.param_groups for p in group["params"]]
    norm = torch.nn.utils.clip_grad_norm_(params, grad_clip)
    optimizer.step()
    return {"loss": total, "grad_norm": float(norm), "tokens": float(sum(len(e.input_ids) for e in examples)),
            "trained_tokens": float(sum(e.trained_tokens for e in examples))}


def eval_loss(model: Any, examples: Sequence[TokenizedConversation], batch_size: int,
              compute_dtype: str | None = None) -> float:
    """Token-mean loss of ``examples`` without gradients (the held-out loss)."""
    import torch

    if not examples:
        return math.nan
    device = next(model.parameters()).device
    cast = (torch.autocast(device.type, dtype=getattr(torch, compute_dtype))
            if compute_dtype and compute_dtype != "float32" else contextlib.nullcontext())
    normalizer = float(sum(e.trained_tokens for e in examples))
    total = 0.0
    was_training = model.training
    model.eval()
    with torch.no_grad(), cast:
        for k in range(0, len(examples), batch_size):
            total += float(sft_loss(model, examples[k : k + batch_size], normalizer=normalizer))
    model.train(was_training)
    return total
