"""Micro-batches for the prompt-shared padded pass, cut where a long tail would pad the rest.

On one process a GRPO batch runs each distinct prompt once and every row's tail (its last prompt
token and response) padded to the longest tail of its pass
(:func:`~agentloop_trainer.update.forward.prompt_shared_log_probs`). One trajectory that rambles
to 250 tokens while the other 127 stop near 50 makes that pass ~5x the work it needs: measured
on the main job (tiny model, one thread), the update took 4-9 s on such steps against 0.9 s on
steps without one.

:func:`shared_prompt_micro_batches` splits the rows, sorted by tail length, into the contiguous
runs that minimise the tokens the passes compute: per pass the common prefix once, each distinct
prompt it touches once (padded to its longest), and its rows times its longest tail, plus a
fixed cost per pass. Gradients accumulate over the micro-batches exactly as with
``ppo_micro_batch_size_per_gpu``, so the update's result does not change; a batch without
outliers stays one pass.
"""

from __future__ import annotations

from collections.abc import Sequence

from agentloop_trainer.update.forward import MIN_SHARED_PREFIX, common_prefix_length

__all__ = ["PASS_COST_TOKENS", "pass_cost", "shared_prompt_micro_batches"]

PASS_COST_TOKENS = 64
"""A forward and backward pass's fixed cost, in tokens' worth of compute (the split must save
more than this to add a pass)."""
MAX_CUTS = 64
"""Most candidate cut points considered (quantiles of the tail lengths beyond that), which keeps
the search O(MAX_CUTS x rows)."""


def _heads(sequences: Sequence[Sequence[int]], prompt_lengths: Sequence[int], rows: Sequence[int]) -> list[tuple[int, ...]]:
    """Each row's prompt but its last token: the part its group's samples share."""
    return [tuple(sequences[r][: max(0, prompt_lengths[r] - 1)]) for r in rows]


def _shared_prefix(distinct: Sequence[Sequence[int]]) -> int:
    """The prefix :func:`~agentloop_trainer.update.forward.prompt_shared_log_probs` runs once
    for these distinct prompts (0 when too short to be worth a pass)."""
    if len(distinct) < 2:
        return 0
    prefix = min(common_prefix_length(distinct), min(len(h) for h in distinct) - 1)
    return prefix if prefix >= MIN_SHARED_PREFIX else 0


def _cost(prefix: int, distinct: int, longest_head: int, rows: int, longest_tail: int) -> int:
    """Tokens of one prompt-shared pass: the shared ``prefix`` once, ``distinct`` prompts' rest
    padded to ``longest_head``, ``rows`` tails padded to ``longest_tail``, plus the pass's fixed
    cost."""
    return PASS_COST_TOKENS + prefix + distinct * max(1, longest_head - prefix) + rows * longest_tail


def pass_cost(sequences: Sequence[Sequence[int]], prompt_lengths: Sequence[int], rows: Sequence[int]) -> int:
    """Tokens one prompt-shared pass over ``rows`` computes (:func:`_cost` with the rows' own
    shared prefix)."""
    heads = _heads(sequences, prompt_lengths, rows)
    distinct = list(dict.fromkeys(heads))
    longest_tail = max(len(sequences[r]) - len(h) for r, h in zip(rows, heads, strict=True))
    return _cost(_shared_prefix(distinct), len(distinct), max(map(len, distinct)), len(rows), longest_tail)


def shared_prompt_micro_batches(sequences: Sequence[Sequence[int]], prompt_lengths: Sequence[int],
                                rows: Sequence[int]) -> list[list[int]]:
    """``rows`` in micro-batches for the prompt-shared padded pass, fewest tokens in all.

    Rows are sorted by tail length (``len(sequence) - prompt_length + 1``) and cut into
    contiguous runs by dynamic programming over at most :data:`MAX_CUTS` cut points, each run's
    cost being :func:`pass_cost` (with the whole batch's shared prefix, which a run's own is at
    least as long as).

    Args:
        sequences: Every row's prompt + response ids (indexed by row).
        prompt_lengths: Every row's prompt length (indexed by row).
        rows: The rows to split (one mini-batch).

    Returns:
        Lists of row indices, each ascending, every row in exactly one; ``[rows]`` (one pass)
        when no cut saves tokens. Deterministic.
    """
    rows = list(rows)
    if len(rows) < 2:
        return [rows] if rows else []
    heads = dict(zip(rows, _heads(sequences, prompt_lengths, rows), strict=True))
    tail = {r: len(sequences[r]) - len(heads[r]) for r in rows}
    order = sorted(rows, key=lambda r: (tail[r], r))
    prefix = _shared_prefix(list(dict.fromkeys(heads[r] for r in order)))
    n = len(order)
    changes = [k for k in range(1, n) if tail[order[k]] != tail[order[k - 1]]]
    if len(changes) > MAX_CUTS:
        changes = [changes[(i * len(changes)) // MAX_CUTS] for i in range(MAX_CUTS)]
    cuts = [0, *changes, n]
    m = len(cuts)
    # best[b]: the cheapest cutting of order[:cuts[b]]; each start a sweeps its run forward.
    best = [0.0] + [float("inf")] * (m - 1)
    back = [0] * m
    for a in range(m - 1):
        seen: set[tuple[int, ...]] = set()
        longest_head = 0
        k = cuts[a]
        for b in range(a + 1, m):
            for r in order[k : cuts[b]]:
                if heads[r] not in seen:
                    seen.add(heads[r])
                    longest_head = max(longest_head, len(heads[r]))
            k = cuts[b]
            cost = _cost(prefix, len(seen), longest_head, cuts[b] - cuts[a], tail[order[cuts[b] - 1]])
            if best[a] + cost < best[b]:
                best[b], back[b] = best[a] + cost, a
    parts: list[list[int]] = []
    b = m - 1
    while b > 0:
        a = back[b]
        parts.append(sorted(order[cuts[a] : cuts[b]]))
        b = a
    return sorted(parts, key=lambda p: p[0])
