"""Per-row sampling for a batch of requests that each carry their own parameters.

Log-prob convention (what ``TokenOutput.log_probs`` holds for HFServer): the log-prob of the
sampled token under ``log_softmax(logits / T)`` over the tokens the row may draw, before
top-k/top-p filtering, with ``T = 1`` for greedy requests (``temperature == 0``). That is
exactly what a trainer recomputes with a forward pass at the same temperature, so rollout and
training log-probs agree up to numerics. Top-k/top-p filtering only changes which token is drawn.

Banned ids (:attr:`RowSampling.banned`: a vision-language model's image and video placeholder
ids, :mod:`agentloop_engines.adapters.placeholders`) are removed from the distribution itself: they are
never drawn, greedy included (greedy takes the best allowed token), and the log-prob is taken
over the other tokens (``log_softmax`` with the banned logits at ``-inf``), as vLLM and SGLang
report it and the trainer recomputes it (``agentloop_trainer.update.placeholder_mask``). Bans
apply before top-k/top-p (the k kept tokens are the k best allowed ones). A row that bans
nothing (a text model) gets the full-vocabulary log-prob, at no extra cost.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class RowSampling:
    """Sampling settings of one batch row, prepared once per request."""

    temperature: float
    """0 means greedy."""
    top_k: int
    """Keep the k most likely tokens; <= 0 disables."""
    top_p: float
    """Nucleus mass in (0, 1]; 1 disables."""
    generator: torch.Generator | None
    """Per-request RNG (None for greedy rows), so a seeded request samples the same tokens
    whatever else shares its batch."""
    banned: tuple[int, ...] = ()
    """Ids never drawn (all below the logits' width); empty: nothing is banned, at no cost."""


def sample_rows(logits: torch.Tensor, rows: list[RowSampling]) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row and return it with its log-prob.

    Args:
        logits: ``[B, V]`` next-token logits (any float dtype; computed in float32).
        rows: One :class:`RowSampling` per row of ``logits``.

    Returns:
        ``(token_ids [B] long, log_probs [B] float32)``; log-probs follow the module convention.
    """
    logits = logits.float()
    device = logits.device
    temps = torch.tensor([r.temperature if r.temperature > 0 else 1.0 for r in rows], device=device)
    scaled = logits / temps[:, None]
    # Banned ids go to -inf in `scaled` itself (its own tensor): the log-probs are then over the
    # allowed tokens, and greedy rows (scaled by 1) take their best allowed logit.
    banned = _ban_(scaled, rows)
    log_probs = torch.log_softmax(scaled, dim=-1)
    tokens = torch.argmax(scaled if banned else logits, dim=-1)

    sampled = [i for i, r in enumerate(rows) if r.temperature > 0]
    if sampled:
        every = len(sampled) == len(rows)
        idx = None if every else torch.tensor(sampled, device=device)
        filtered = _filter(scaled if every else scaled[idx], [rows[i] for i in sampled])
        probs = torch.softmax(filtered, dim=-1)
        drawn = _draw(probs, [rows[i].generator for i in sampled])
        if every:
            tokens = drawn
        else:
            tokens[idx] = drawn
    chosen = log_probs.gather(1, tokens[:, None])[:, 0]
    return tokens, chosen


def _draw(probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    """One token per row of ``probs``, each row from its own generator.

    This is the exponential race ``torch.multinomial(p, 1)`` itself runs (``argmax(p / q)``
    with ``q ~ Exp(1)`` drawn from the row's generator), so a seeded request draws exactly the
    tokens it drew through ``multinomial``; only the noise is drawn row by row, the division and
    argmax run once for the batch (a ``multinomial`` call per row cost about twice as much).
    """
    if not bool(((probs >= 0) & (probs < float("inf"))).all()):
        raise ValueError("sampling probabilities contain inf, nan or a negative value (are the logits finite?)")
    noise = torch.empty_like(probs)
    for j, generator in enumerate(generators):
        noise[j].exponential_(generator=generator)
    return torch.argmax(probs / noise, dim=-1)


def _ban_(scaled: torch.Tensor, rows: list[RowSampling]) -> bool:
    """Set each row's banned ids to -inf in ``scaled``, in place; False (nothing touched) when no
    row bans anything. Rows are grouped by their banned set: one server bans the same ids in
    every row, so that is one indexed write."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for i, r in enumerate(rows):
        if r.banned:
            groups.setdefault(r.banned, []).append(i)
    for ids, members in groups.items():
        cols = torch.tensor(ids, device=scaled.device)
        if len(members) == len(rows):
            scaled[:, cols] = float("-inf")
        else:
            scaled[torch.tensor(members, device=scaled.device)[:, None], cols[None, :]] = float("-inf")
    return bool(groups)


def _filter(scaled: torch.Tensor, rows: list[RowSampling]) -> torch.Tensor:
    """Mask (to -inf) what each row's top-k / top-p excludes."""
    vocab = scaled.shape[-1]
    ks = [r.top_k if 0 < r.top_k < vocab else vocab for r in rows]
    # top_p == 1 must keep every token even when rounding pushes the running mass past 1.
    ps = [r.top_p if r.top_p < 1.0 else 2.0 for r in rows]
    if all(k == vocab for k in ks) and all(p > 1.0 for p in ps):
        return scaled
    device = scaled.device
    sorted_logits, sorted_idx = torch.sort(scaled, dim=-1, descending=True)
    rank = torch.arange(vocab, device=device)[None, :]
    remove = rank >= torch.tensor(ks, device=device)[:, None]
    probs = torch.softmax(sorted_logits.masked_fill(remove, float("-inf")), dim=-1)
    # A token is dropped when the mass before it already reaches top_p; the first always stays.
    mass_before = torch.cumsum(probs, dim=-1) - probs
    remove |= mass_before >= torch.tensor(ps, device=device)[:, None]
    remove[:, 0] = False
    mask = torch.zeros_like(remove).scatter(1, sorted_idx, remove)
    return scaled.masked_fill(mask, float("-inf"))
