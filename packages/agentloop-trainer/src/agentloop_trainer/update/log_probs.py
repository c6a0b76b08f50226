"""Response log-probs of a :class:`~agentloop_trainer.update.policy_batch.PolicyBatch` and its
split into micro-batches (one forward/backward pass each)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from agentloop_trainer.update.forward import prompt_groups, prompt_shared_log_probs, sequence_log_probs
from agentloop_trainer.update.packing import packed_log_probs
from agentloop_trainer.update.policy_batch import PolicyBatch
from agentloop_trainer.update.step_prefix import StepPrefix
from agentloop_trainer.update.vision_forward import multimodal_log_probs, vision_token_id


def response_log_probs(model: Any, pb: PolicyBatch, temperature: float = 1.0, rows: Sequence[int] | None = None,
                       share_prefix: bool = True, device: Any = None, share_prompts: bool = False,
                       packed: bool = False, prefix: StepPrefix | None = None) -> Any:
    """Log-probs of each response token under ``model``, shaped like ``pb.response_mask``.

    Args:
        model: The policy (plain or FSDP-sharded).
        pb: The unpadded batch.
        temperature: The sampling temperature.
        rows: Subset of rows (a mini-batch); None: all.
        share_prefix: Compute the rows' common prefix once (see
            :func:`~agentloop_trainer.update.forward.sequence_log_probs`).
        device: Where the inputs go; None: the model's first parameter's device (pass it when
            parameters are offloaded to the host).
        share_prompts: With ``share_prefix``, run each distinct prompt once when rows repeat
            prompts (a GRPO group; :func:`~agentloop_trainer.update.forward.prompt_shared_log_probs`).
            One process only: the forward calls it makes depend on the data.
        packed: Run the rows as one packed row (:func:`~agentloop_trainer.update.packing.packed_log_probs`;
            text models only, rows with images stay padded); the sharing options are then unused.
        prefix: The prompt prefix every row shares, already run for the whole step (one
            process, padded text passes; :class:`~agentloop_trainer.update.step_prefix.StepPrefix`).
    """
    import torch

    rows = list(range(len(pb.sequences))) if rows is None else list(rows)
    groups = None
    if share_prefix and share_prompts and not packed:
        groups = prompt_groups([pb.sequences[r] for r in rows], [pb.prompt_lengths[r] for r in rows])
    # A failed sample can come back with no tokens at all; it is masked out, but the forward
    # still needs a row, so give it a 2-token stand-in (pad ids) instead of crashing the step.
    seqs = [pb.sequences[r] if len(pb.sequences[r]) >= 2 else (list(pb.sequences[r]) * 2 or [0, 0]) for r in rows]
    first = min((pb.prompt_lengths[r] for r in rows if pb.prompt_lengths[r] > 0), default=1)
    idle: list[bool] = [False] * len(rows)
    if pb.images is not None and any(pb.images[r] for r in rows):
        # Rows with images: one forward with their pixel values (no shared prefix: the image
        # tokens' embeddings come from the vision tower, not the embedding table). A row that
        # trains nothing (a failed sample, a row masked for its cut) is scored as the stand-in
        # too: its images need not fill its tokens (a failure keeps its prompt's ids, maybe not
        # its images) and a vision forward for it would be wasted.
        idle = (pb.response_mask[rows].sum(dim=1) == 0).tolist()
        stand_in = [_stand_in_id(model)] * 2
        seqs = [stand_in if skip else seq for seq, skip in zip(seqs, idle, strict=True)]
        images = [() if skip or len(pb.sequences[r]) < 2 else pb.images[r] for r, skip in zip(rows, idle, strict=True)]
        logp = multimodal_log_probs(model, seqs, images, temperature=temperature, device=device)
    elif packed:
        logp = packed_log_probs(model, seqs, [pb.prompt_lengths[r] for r in rows], temperature=temperature,
                                device=device)
    elif groups is not None:
        logp = prompt_shared_log_probs(model, seqs, [pb.prompt_lengths[r] for r in rows], groups,
                                       temperature=temperature, device=device, prefix=prefix)
    else:
        logp = sequence_log_probs(model, seqs, temperature=temperature, first_scored=first,
                                  share_prefix=share_prefix, device=device, prefix=prefix)
    R = pb.response_mask.shape[1]
    out = torch.zeros((len(rows), R), dtype=logp.dtype, device=logp.device)
    for i, r in enumerate(rows):
        p = pb.prompt_lengths[r]
        n = min(len(pb.sequences[r]) - p, R)
        if n > 0 and p > 0 and not idle[i]:
            # logp[t] scores token t+1, so response token j (at position p+j) is logp[p+j-1].
            out[i, :n] = logp[i, p - 1 : p - 1 + n]
    if logp.requires_grad and not out.requires_grad:
        # No row had a response (a micro-batch of failed samples): the result still joins the
        # graph, so the caller's backward runs (all zeros) instead of raising.
        out = out + 0.0 * logp.sum()
    return out


def _stand_in_id(model: Any) -> int:
    """The id a stand-in row repeats in a vision forward: 0, or 1 where 0 is the image
    placeholder (a placeholder would need an image)."""
    return 1 if vision_token_id(model) == 0 else 0


def micro_batches(rows: Sequence[int], lengths: Sequence[int], size: int | None = None,
                  max_tokens: int | None = None) -> list[list[int]]:
    """Split ``rows`` into micro-batches, each run as one forward/backward pass.

    Args:
        rows: Row indices (one rank's share of a mini-batch).
        lengths: Token length of every row of the batch (indexed by row).
        size: Rows per micro-batch (fixed count); None with ``max_tokens`` None: one micro-batch.
        max_tokens: Token budget per micro-batch, counted as a padded forward pays it (rows x
            longest row); rows are taken longest first so similar lengths share a pass. A row
            longer than the budget gets a micro-batch of its own. Wins over ``size``.

    Returns:
        Lists of row indices; every row is in exactly one.
    """
    rows = list(rows)
    if max_tokens is not None:
        out: list[list[int]] = []
        current: list[int] = []
        longest = 0
        for r in sorted(rows, key=lambda r: (-lengths[r], r)):
            n = max(1, lengths[r])
            if current and (len(current) + 1) * max(longest, n) > max_tokens:
                out.append(sorted(current))
                current, longest = [], 0
            current.append(r)
            longest = max(longest, n)
        if current:
            out.append(sorted(current))
        return out
    if size is None or size >= len(rows):
        return [rows] if rows else []
    return [rows[i : i + size] for i in range(0, len(rows), size)]
