"""Variable-length sdpa attention for packed rows: each sequence attends within itself only.

transformers isolates packed sequences with a block-diagonal mask (see
:mod:`~agentloop_trainer.update.packing`), but sdpa and eager on CPU then compute the scores of
the whole row, masked blocks included: a packed row of ``T`` tokens costs ``T^2`` per layer
where its sequences need ``sum(n_i^2)``. At 8192 tokens of 256-token sequences that made the
tiny model's packed forward 40x slower than the padded one. Flash attention takes the packed
boundaries as ``cu_seq_lens_q`` / ``cu_seq_lens_k`` keyword arguments (its varlen kernel); this
module gives sdpa the same arguments: :func:`install` wraps transformers' ``sdpa`` attention
function so that, when they are present, it runs sdpa once per sequence (causal, and banded
for a sliding-window layer such as Gemma3's local ones) and concatenates the outputs.

Without those arguments (every call but a packed forward: padded passes, generation, other
models in the process) the wrapper calls the original function with the same arguments, so
installing it changes nothing else. The packed forward keeps transformers' own block-diagonal
mask as well, so a model whose attention never receives the keyword arguments still computes
isolated sequences, only at the dense cost.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["install", "packed_attention_calls", "packed_sdpa_attention"]

_ORIGINAL_SDPA: list[Callable[..., Any]] = []
"""transformers' own ``sdpa`` attention function, saved by :func:`install`."""
_CALLS = [0]
"""Packed calls handled so far (:func:`packed_attention_calls`)."""


def packed_attention_calls() -> int:
    """How many attention calls ran per sequence so far in this process: a packed forward
    that leaves it unchanged never reached :func:`packed_sdpa_attention`."""
    return _CALLS[0]


def packed_sdpa_attention(module: Any, query: Any, key: Any, value: Any, attention_mask: Any,
                          dropout: float = 0.0, scaling: float | None = None, sliding_window: int | None = None,
                          **kwargs: Any) -> tuple[Any, None]:
    """transformers' ``sdpa`` attention, per sequence when the call carries ``cu_seq_lens_q``.

    Args:
        module: The attention layer (``is_causal``, ``num_key_value_groups`` are read from it).
        query: ``[1, H, T, D]`` for a packed row (``[B, H, q, D]`` otherwise).
        key: ``[1, Hkv, T, D]``.
        value: ``[1, Hkv, T, D]``.
        attention_mask: transformers' mask; ignored in the packed case (the boundaries replace it).
        dropout: Attention dropout probability.
        scaling: Score scale (None: ``1/sqrt(D)``).
        sliding_window: The layer's window, or None for a full-attention layer.
        **kwargs: ``cu_seq_lens_q`` (cumulative sequence lengths, ``[S+1]``, starting at 0) marks
            a packed row; the rest go to the original function.

    Returns:
        ``([B, T, H, D], None)`` like transformers' ``sdpa_attention_forward``.
    """
    import torch

    original = _ORIGINAL_SDPA[0]
    cu = kwargs.get("cu_seq_lens_q")
    T = query.shape[2]
    if cu is None or query.shape[0] != 1 or int(cu[-1]) != T or key.shape[2] != T:
        return original(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                        sliding_window=sliding_window, **kwargs)
    rest = {k: v for k, v in kwargs.items() if k not in ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q",
                                                          "max_length_k", "is_causal", "position_ids")}
    _CALLS[0] += 1
    bounds = [int(b) for b in cu.tolist()]
    outputs = []
    for a, b in zip(bounds[:-1], bounds[1:], strict=True):
        n = b - a
        mask = None
        if sliding_window is not None and n > sliding_window:
            # transformers' sliding_window_overlay: key k is visible to query q when q - window < k <= q.
            q_idx = torch.arange(n, device=query.device).unsqueeze(1)
            k_idx = torch.arange(n, device=query.device).unsqueeze(0)
            mask = ((k_idx <= q_idx) & (k_idx > q_idx - sliding_window))[None, None]
        out, _ = original(module, query[:, :, a:b], key[:, :, a:b], value[:, :, a:b], mask, dropout=dropout,
                          scaling=scaling, sliding_window=sliding_window, **rest)
        outputs.append(out)
    return torch.cat(outputs, dim=1), None


def install() -> None:
    """Put :func:`packed_sdpa_attention` in place of transformers' ``sdpa`` attention function
    (process-wide, once; a pass-through for every call without ``cu_seq_lens_q``)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

    current = ALL_ATTENTION_FUNCTIONS["sdpa"]
    if current is packed_sdpa_attention:
        return
    _ORIGINAL_SDPA[:] = [current]
    AttentionInterface.register("sdpa", packed_sdpa_attention)
