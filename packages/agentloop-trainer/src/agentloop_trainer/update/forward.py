"""Per-token log-probs of whole sequences, computing a prefix that all rows share only once.

Every prompt of a task starts with the same system turn and tool schemas (about 260 of ~370
tokens for the calculator task). Running that prefix once with batch size 1 and broadcasting
its key/value cache to the batch gives the same numbers as a full forward (to float rounding)
and cuts the work about threefold, in both SFT and the GRPO update. Gradients flow through the
shared cache into the prefix computation, so training is unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from agentloop_trainer.update.placeholder_mask import banned_token_ids, token_log_probs
from agentloop_trainer.update.step_prefix import StepPrefix


def common_prefix_length(sequences: Sequence[Sequence[int]]) -> int:
    """Length of the longest prefix every sequence shares."""
    if not sequences:
        return 0
    first = sequences[0]
    n = min(len(s) for s in sequences)
    for i in range(n):
        t = first[i]
        if any(s[i] != t for s in sequences):
            return i
    return n


def _cache_kwarg(model: Any) -> str:
    """``cache`` (transformers >= 5.2x) or ``past_key_values`` (older): an unknown keyword
    would be swallowed by ``**kwargs`` and the tail would silently run without its prefix."""
    import inspect

    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # peft's forward takes **kwargs
    params = inspect.signature(type(base).forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def sequence_log_probs(model: Any, sequences: Sequence[Sequence[int]], temperature: float = 1.0,
                       share_prefix: bool = True, pad_id: int = 0, first_scored: int = 1, device: Any = None,
                       prefix: StepPrefix | None = None) -> Any:
    """Log-prob of each next token of each sequence under ``model``.

    Args:
        model: A causal LM (Hugging Face ``*ForCausalLM``, possibly FSDP-wrapped).
        sequences: Unpadded token id lists (prompt then response), each at least 2 long.
        temperature: Logits are divided by it, matching the engine's sampling distribution
            (a vision-language model's placeholder ids removed from it, as every engine does:
            :mod:`~agentloop_trainer.update.placeholder_mask`).
        share_prefix: Compute the rows' common prefix once (exact; faster).
        pad_id: Id used for right padding (never scored).
        first_scored: Index of the first token whose log-prob the caller needs (e.g. the
            shortest prompt length); earlier entries come back 0. The vocabulary projection and
            softmax then run only from there on: with ~30 trained tokens in ~400 they are most
            of the cost that does not change the result.
        device: Where the inputs go; None: the device of the model's first parameter.
        prefix: A prefix already run for the whole optimizer step (:class:`StepPrefix`, one
            process only): every row must start with its ids and score nothing inside it
            (``first_scored > prefix.length``); the rows then run on its cache alone.

    Returns:
        A float tensor ``[B, N-1]`` (N = longest sequence) where ``[b, t]`` is
        ``log p(seq_b[t+1] | seq_b[:t+1])``; entries past a row's end and before
        ``first_scored - 1`` are 0.
    """
    import torch

    if not sequences or min(len(s) for s in sequences) < 2:
        raise ValueError("sequence_log_probs needs at least one sequence, each of 2+ tokens")
    device = device if device is not None else next(model.parameters()).device
    B = len(sequences)
    N = max(len(s) for s in sequences)
    ids = torch.full((B, N), pad_id, dtype=torch.long)
    valid = torch.zeros((B, N), dtype=torch.long)
    for b, s in enumerate(sequences):
        ids[b, : len(s)] = torch.as_tensor(list(s), dtype=torch.long)
        valid[b, : len(s)] = 1
    ids, valid = ids.to(device), valid.to(device)
    # Keep at least one token per row outside the prefix so every row has its own query. The
    # split is made whenever share_prefix is on (P >= 1), so the number of forward calls never
    # depends on the data: FSDP ranks must make the same collective calls in the same order.
    shared = common_prefix_length(sequences) if share_prefix or prefix is not None else 0
    P = max(1, min(shared, min(len(s) for s in sequences) - 1)) if share_prefix else 0
    # Logits are needed at positions start .. N-2 (position t predicts token t+1).
    start = min(max(0, first_scored - 1), N - 2)
    if prefix is not None:
        P = prefix.length
        fits = start >= P and min(len(s) for s in sequences) > P and shared >= P
        if not fits or tuple(sequences[0][:P]) != prefix.ids:
            raise ValueError(f"a StepPrefix of {P} tokens needs rows that start with it, are longer and score "
                             f"nothing inside it (the rows share {shared} tokens, the first scored is at "
                             f"{first_scored})")
        positions = torch.arange(P, N, device=device).unsqueeze(0).expand(B, -1)
        attention = torch.cat([torch.ones((B, P), dtype=torch.long, device=device), valid[:, P:]], dim=1)
        logits = model(input_ids=ids[:, P:], attention_mask=attention, position_ids=positions, use_cache=True,
                       logits_to_keep=N - start, **{_cache_kwarg(model): prefix.cache(B)}).logits
    elif P >= 1:
        # HF keeps the last k positions' logits (k=0 would mean "all", so at least one).
        keep_head = max(1, P - start)
        head = model(input_ids=ids[:1, :P], use_cache=True, logits_to_keep=keep_head)
        cache = getattr(head, "cache", None) or head.past_key_values  # renamed in transformers 5.x
        cache.batch_repeat_interleave(B)
        positions = torch.arange(P, N, device=device).unsqueeze(0).expand(B, -1)
        attention = torch.cat([torch.ones((B, P), dtype=torch.long, device=device), valid[:, P:]], dim=1)
        kw = {_cache_kwarg(model): cache}
        tail = model(input_ids=ids[:, P:], attention_mask=attention, position_ids=positions, use_cache=True,
                     logits_to_keep=N - max(start, P), **kw)
        # The head's logits always join the graph (sliced off when unneeded, so they get zero
        # gradient): FSDP ranks must run the same backward whatever their data.
        logits = torch.cat([head.logits.expand(B, -1, -1), tail.logits], dim=1)
        if start >= P:  # the head's one kept position precedes start: drop it
            logits = logits[:, keep_head:]
    else:
        logits = model(input_ids=ids, attention_mask=valid, use_cache=False, logits_to_keep=N - start).logits
    # logits[:, j] is position start + j; the last position predicts nothing (not scored).
    picked = token_log_probs(logits, ids[:, start + 1 :], banned_token_ids(model), temperature)
    logp = torch.nn.functional.pad(picked, (start, 0))
    return logp * valid[:, 1:]


MIN_SHARED_PREFIX = 16
"""Shortest prefix common to every distinct prompt worth a forward pass of its own."""


def prompt_groups(sequences: Sequence[Sequence[int]], prompt_lengths: Sequence[int]) -> list[int] | None:
    """Which distinct prompt each row has (an index per row, in order of first appearance), or
    None when sharing prompts would not pay: no two rows share a prompt, or a row's prompt is
    shorter than 2 tokens (its first scored logit would sit in the shared part)."""
    if any(p < 2 or len(s) < p for s, p in zip(sequences, prompt_lengths, strict=True)):
        return None
    seen: dict[tuple[int, ...], int] = {}
    groups = [seen.setdefault(tuple(s[: p - 1]), len(seen)) for s, p in zip(sequences, prompt_lengths, strict=True)]
    return groups if len(seen) < len(groups) else None


def prompt_shared_log_probs(model: Any, sequences: Sequence[Sequence[int]], prompt_lengths: Sequence[int],
                            groups: Sequence[int], temperature: float = 1.0, pad_id: int = 0,
                            device: Any = None, prefix: StepPrefix | None = None) -> Any:
    """:func:`sequence_log_probs` for a GRPO batch, running each distinct prompt once.

    The ``n`` samples of a prompt repeat it ``n`` times; here the prefix all rows share runs
    once (when it is at least ``MIN_SHARED_PREFIX`` tokens), the rest of each distinct prompt (all but its last token) once per prompt, and only
    each row's last prompt token plus response runs per row, on top of its prompt's key/value
    cache. With 8 prompts of ~30 tokens x 4 samples of ~32 tokens that is a third fewer tokens
    through the model than one padded batch. Same numbers as a full forward (to float rounding);
    gradients flow through both caches into the shared parts.

    Which rows share what depends on the data, so it is for one process (FSDP ranks must make
    the same collective calls): the actor uses it only on one (plain, or FSDP2 over one rank).

    Args:
        model: A causal LM (Hugging Face ``*ForCausalLM``).
        sequences: Unpadded prompt + response ids per row.
        prompt_lengths: Prompt tokens per row, each at least 2 and at most its sequence's length.
        groups: Per row, the index of its distinct prompt (:func:`prompt_groups`): rows of one
            index must have the same prompt.
        temperature: Logits are divided by it.
        pad_id: Id used for padding (never scored).
        device: Where the inputs go; None: the device of the model's first parameter.
        prefix: The prefix every prompt shares, already run for the whole step
            (:class:`StepPrefix`): it replaces the shared pass; each distinct prompt must be at
            least one token longer.

    Returns:
        ``[B, N-1]`` like :func:`sequence_log_probs`, filled from each row's last prompt token on
        (``[b, t]`` for ``t >= prompt_lengths[b] - 1``); earlier entries are 0.
    """
    import torch

    device = device if device is not None else next(model.parameters()).device
    B, U = len(sequences), max(groups) + 1
    first_row = {g: b for b, g in reversed(list(enumerate(groups)))}
    heads = [list(sequences[first_row[u]][: prompt_lengths[first_row[u]] - 1]) for u in range(U)]
    P = min(common_prefix_length(heads), min(len(h) for h in heads) - 1)
    kw_name = _cache_kwarg(model)
    kw: dict[str, Any] = {}
    passes = []
    if prefix is not None:
        if prefix.length > P or tuple(heads[0][: prefix.length]) != prefix.ids:
            raise ValueError(f"a StepPrefix of {prefix.length} tokens needs prompts that start with it and are "
                             f"longer (the prompts share {P} tokens before their last)")
        P = prefix.length
        kw[kw_name] = prefix.cache(U)
    elif U == 1 or P < MIN_SHARED_PREFIX:
        P = 0  # not worth a pass of its own
    S = max(len(h) for h in heads)
    if P and prefix is None:
        # The prefix every prompt shares: batch 1, then one copy per distinct prompt.
        passes.append(model(input_ids=torch.tensor([heads[0][:P]], device=device), use_cache=True, logits_to_keep=1))
        cache = getattr(passes[-1], "cache", None) or passes[-1].past_key_values
        cache.batch_repeat_interleave(U)
        kw[kw_name] = cache
    # Each prompt's own part, right-padded to the longest (pad slots are masked from then on).
    ids = torch.full((U, max(1, S - P)), pad_id, dtype=torch.long)
    head_mask = torch.zeros((U, P + ids.shape[1]), dtype=torch.long)
    head_mask[:, :P] = 1
    for u, h in enumerate(heads):
        ids[u, : len(h) - P] = torch.as_tensor(h[P:], dtype=torch.long)
        head_mask[u, P : len(h)] = 1
    ids, head_mask = ids.to(device), head_mask.to(device)
    positions = torch.arange(P, P + ids.shape[1], device=device).unsqueeze(0).expand(U, -1)
    mid = model(input_ids=ids, attention_mask=head_mask, position_ids=positions, use_cache=True,
                logits_to_keep=1, **kw)
    passes.append(mid)
    cache = getattr(mid, "cache", None) or mid.past_key_values
    cache.batch_select_indices(torch.as_tensor(list(groups), device=device))
    # Each row from its last prompt token on: position p-1 predicts the first response token.
    starts = [p - 1 for p in prompt_lengths]
    T = max(len(s) - st for s, st in zip(sequences, starts, strict=True))
    tail = torch.full((B, T), pad_id, dtype=torch.long)
    valid = torch.zeros((B, T), dtype=torch.long)
    for b, (s, st) in enumerate(zip(sequences, starts, strict=True)):
        tail[b, : len(s) - st] = torch.as_tensor(list(s[st:]), dtype=torch.long)
        valid[b, : len(s) - st] = 1
    tail, valid = tail.to(device), valid.to(device)
    start_t = torch.as_tensor(starts, device=device)
    positions = start_t.unsqueeze(1) + torch.arange(T, device=device).unsqueeze(0)
    attention = torch.cat([head_mask[torch.as_tensor(list(groups), device=device)], valid], dim=1)
    logits = model(input_ids=tail, attention_mask=attention, position_ids=positions, use_cache=True,
                   **{kw_name: cache}).logits
    picked = token_log_probs(logits, tail[:, 1:], banned_token_ids(model), temperature)
    picked = picked * valid[:, 1:]
    # The shared passes' logits join the graph at zero weight, as in sequence_log_probs: under
    # FSDP2 (one rank, for CPU offload) a forward whose output backward never reaches leaves
    # its parameters resharded when the backward needs them.
    picked = picked + 0.0 * sum(p.logits.sum() for p in passes)
    # Row b's tail entry j scores token starts[b] + j + 1: put it at column starts[b] + j.
    N = max(len(s) for s in sequences)
    logp = torch.zeros((B, max(starts) + T), dtype=picked.dtype, device=device)
    return logp.scatter(1, positions[:, :-1], picked)[:, : N - 1]
