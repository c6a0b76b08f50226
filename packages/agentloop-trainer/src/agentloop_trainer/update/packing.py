"""Padding-free (packed) forward passes: a micro-batch's sequences concatenated into one row.

A padded micro-batch pays for ``rows x longest row`` tokens; a tool-agent batch (many short
trajectories, a few long ones) then spends most of its forward and backward on padding. Packed,
the row holds exactly the batch's tokens, with position ids restarting at 0 for each sequence.

Isolation between the sequences comes from transformers itself: with ``attention_mask=None``,
no cache and ``position_ids`` given, ``masking_utils._preprocess_mask_arguments`` calls
``find_packed_sequence_indices`` (a new sequence starts wherever the position id does not grow
by 1) and ANDs a same-sequence mask into the causal (and, for Gemma3's sliding layers, the
sliding-window, computed on the restarted positions) mask of the eager and sdpa attention; flash
attention takes the same position ids as varlen boundaries. Every decoder model built on
``create_causal_mask`` gets this (Llama, Qwen2/3, Gemma3, ...); ``tests/test_packing.py`` checks
a token's log-prob in a packed row equals its log-prob alone for the three families.

The cost of the block-diagonal mask: sdpa and eager on CPU compute the attention scores of the
whole row (masked blocks included), quadratic in the packed row's length, so rows are bounded
by a token budget (:func:`packed_micro_batches`); the vocabulary projection, the largest single
matmul of a small model, runs only at the positions that score a token (``logits_to_keep`` with
an index tensor). Vision-language models stay on the padded path (their M-RoPE positions come
from the image grids, per row).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from agentloop_trainer.update.forward import prompt_groups
from agentloop_trainer.update.packed_attention import install, packed_attention_calls
from agentloop_trainer.update.placeholder_mask import banned_token_ids, token_log_probs

__all__ = ["packed_log_probs", "packed_micro_batches", "packed_positions", "packs"]


def packs(model: Any) -> bool:
    """Whether ``model`` (plain, peft- or FSDP-wrapped) runs packed: a text model. A
    vision-language model (its config has a ``vision_config``) stays padded: its M-RoPE
    positions are computed per row from the image grids."""
    return getattr(getattr(model, "config", None), "vision_config", None) is None


def packing_pays(sequences: Sequence[Sequence[int]], prompt_lengths: Sequence[int], rows: Sequence[int]) -> bool:
    """Whether packing ``rows`` computes fewer tokens than the padded pass that runs each
    distinct prompt once (:func:`~agentloop_trainer.update.forward.prompt_shared_log_probs`): the
    rows' tokens summed, against each distinct prompt once plus every row padded to the longest
    tail (its last prompt token and response). True when no two rows share a prompt. A GRPO
    group of n samples of a long prompt with short answers (the main job: 16 prompts x 8 samples
    of ~330 + ~80 tokens) runs about 3x fewer tokens shared; mixed-length multi-turn rows pack."""
    seqs = [sequences[r] for r in rows]
    prompts = [prompt_lengths[r] for r in rows]
    groups = prompt_groups(seqs, prompts)
    if groups is None:
        return True
    distinct = {g: p - 1 for g, p in zip(groups, prompts, strict=True)}
    longest_tail = max(len(s) - p + 1 for s, p in zip(seqs, prompts, strict=True))
    return sum(map(len, seqs)) < sum(distinct.values()) + len(seqs) * longest_tail


def packed_positions(lengths: Sequence[int]) -> list[int]:
    """Position ids of sequences of ``lengths`` packed in one row: ``0 .. n-1`` per sequence."""
    return [t for n in lengths for t in range(n)]


def packed_micro_batches(rows: Sequence[int], lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Split ``rows`` into packed micro-batches of at most ``max_tokens`` tokens each.

    First-fit decreasing: rows are taken longest first and each goes into the first micro-batch
    with room, so few micro-batches come out nearly full. A row longer than the budget gets one
    of its own. Deterministic (ties by row index), so a rerun packs the same way.

    Args:
        rows: Row indices (one rank's share of a mini-batch).
        lengths: Token length of every row of the batch (indexed by row).
        max_tokens: Tokens per packed row (``ppo_max_token_len_per_gpu``).

    Returns:
        Lists of row indices, each in ascending order; every row is in exactly one.
    """
    if max_tokens < 1:
        raise ValueError(f"ppo_max_token_len_per_gpu must be at least 1 (got {max_tokens})")
    bins: list[list[int]] = []
    room: list[int] = []
    for r in sorted(rows, key=lambda r: (-lengths[r], r)):
        n = max(1, lengths[r])
        for i, free in enumerate(room):
            if n <= free:
                bins[i].append(r)
                room[i] -= n
                break
        else:
            bins.append([r])
            room.append(max_tokens - n)
    return [sorted(b) for b in bins]


def packed_log_probs(model: Any, sequences: Sequence[Sequence[int]], first_scored: Sequence[int],
                     temperature: float = 1.0, device: Any = None) -> Any:
    """Log-prob of each next token of each sequence, all sequences in one packed row.

    Args:
        model: A text causal LM (Hugging Face ``*ForCausalLM``, possibly peft- or FSDP-wrapped)
            whose attention masks come from ``create_causal_mask`` (see the module docstring).
        sequences: Unpadded token id lists, each at least 2 long.
        first_scored: Per sequence, the index of the first token whose log-prob is needed (its
            prompt length); earlier entries come back 0 and cost no vocabulary projection.
        temperature: Logits are divided by it, matching the engine's sampling distribution.
        device: Where the inputs go; None: the device of the model's first parameter.

    Returns:
        ``[B, N-1]`` float (N = longest sequence), laid out like
        :func:`~agentloop_trainer.update.forward.sequence_log_probs`: ``[b, t]`` is
        ``log p(seq_b[t+1] | seq_b[:t+1])`` for ``t >= first_scored[b] - 1``, 0 elsewhere.
    """
    import torch

    if not sequences or min(len(s) for s in sequences) < 2:
        raise ValueError("packed_log_probs needs at least one sequence, each of 2+ tokens")
    device = device if device is not None else next(model.parameters()).device
    lengths = [len(s) for s in sequences]
    ids = torch.tensor([t for s in sequences for t in s], dtype=torch.long)
    positions = torch.tensor(packed_positions(lengths), dtype=torch.long)
    # Position k of the row scores token k+1 of the same sequence: sequence b's positions
    # offset + t for t in [first_scored - 1, n - 2].
    rows_b, cols_t, keep = [], [], []
    offset = 0
    for b, (n, f) in enumerate(zip(lengths, first_scored, strict=True)):
        for t in range(max(0, f - 1), n - 1):
            rows_b.append(b)
            cols_t.append(t)
            keep.append(offset + t)
        offset += n
    # With nothing to score, still keep one position: the output joins the graph, so FSDP ranks
    # run the same backward whatever their data.
    scored = bool(keep)
    keep_t = torch.tensor(keep if scored else [offset - 1], dtype=torch.long)
    ids, positions, keep_t = ids.to(device), positions.to(device), keep_t.to(device)
    cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device=device)
    # The cu_seq_lens arguments give flash attention (and packed_sdpa_attention) the sequence
    # boundaries. Under sdpa the dense mask transformers would build from the restarting
    # position ids (T x T, most of a small model's time at a few thousand tokens) is skipped
    # with a stand-in 4-D mask, which packed_sdpa_attention ignores; the call count below proves
    # it ran. Other implementations (eager, flex) get transformers' own block-diagonal mask.
    sdpa = getattr(getattr(model, "config", None), "_attn_implementation", None) == "sdpa"
    mask = None
    if sdpa:
        install()
        mask = torch.ones((1, 1, 1, 1), dtype=torch.bool, device=device)
    calls = packed_attention_calls()
    out = model(input_ids=ids.unsqueeze(0), position_ids=positions.unsqueeze(0), attention_mask=mask,
                use_cache=False, logits_to_keep=keep_t, cu_seq_lens_q=cu, cu_seq_lens_k=cu,
                max_length_q=max(lengths), max_length_k=max(lengths))
    if sdpa and packed_attention_calls() == calls:
        raise RuntimeError(f"{type(model).__name__} does not pass attention keyword arguments (cu_seq_lens_q) to its "
                           "attention layers, so a packed row would attend across sequences; set "
                           "actor_rollout_ref.actor.use_remove_padding=false for this model")
    logits = out.logits[0]
    B, N = len(sequences), max(lengths)
    logp = torch.zeros((B, N - 1), dtype=torch.float32, device=logits.device)
    if not scored:
        return logp + 0.0 * logits.float().sum()
    picked = token_log_probs(logits, ids[keep_t + 1], banned_token_ids(model), temperature)
    index = (torch.tensor(rows_b, device=logits.device), torch.tensor(cols_t, device=logits.device))
    return logp.index_put(index, picked)
