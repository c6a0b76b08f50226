"""Prefix reuse across turns: a replica keeps the KV cache of a trajectory's last turn and
prefills only the new tokens of its next turn.

Design: one entry per ``request_id`` (a trajectory), holding the token ids whose keys and
values were computed (prompt + generated, less the last sampled token, which was never fed)
and those keys/values per layer, for that one row. The router already sends a trajectory's
turns back to the replica that served it (sticky sessions, by ``request_id``), so the id is the
natural key; the next prompt must start with the cached ids, token for token, and the longest
common prefix is reused (the keys of a causal model's first ``m`` tokens depend on those
tokens only, so a partial match is as exact as a full one). A vLLM-style cache of hashed token
blocks would also serve prefixes shared across trajectories, but HFServer already computes a
GRPO group's shared prompt once per prefill, and a block cache would gather scattered blocks
into one tensor per layer on every hit: a copy the size of the whole context, where a
per-trajectory entry is already contiguous.

Entries are bounded by the tokens they hold (least recently used first out; by default as many
as :data:`DEFAULT_PREFIX_CACHE_BYTES` of the model's keys and values hold) and live on the
model's device (on a CPU server that is CPU memory; on CUDA it saves two host copies a turn).
An entry is taken (removed) by the turn that reuses it and stored again when that turn
finishes by stop or length, and dropped when the worker says the trajectory is over
(:meth:`PrefixCache.forget`, ``HFServer.forget_session``): a last turn no one will reuse
would otherwise hold its place until LRU pushes it out, evicting live trajectories' entries
first (an evaluation of 200 two-turn trajectories at 128 rows missed 58 of its 200 second
turns that way); an aborted or failed row stores nothing, so a partial cache is never
kept (an entry left by a request aborted while queued is still exact, and LRU ages it out). :class:`~agentloop_engines.adapters.hf.server.HFServer` clears the cache on weight updates and
sleep. Rows with images never use it (their positions can be 3-D, M-RoPE).
"""

from __future__ import annotations

import collections
import threading
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from transformers.cache_utils import DynamicCache

from agentloop_engines.adapters.hf.growing_cache import left_pad
from agentloop_engines.adapters.hf.vision import text_config

DEFAULT_PREFIX_CACHE_BYTES = 1 << 30
"""The cache's default bound (HFServer ``prefix_cache_tokens=None``): 1 GiB of keys and values,
e.g. 23k tokens of SmolLM2-135M in float32 (46 KB a token), 8k of a 7B Qwen2 in bfloat16."""


@dataclass(frozen=True)
class _Entry:
    ids: tuple[int, ...]
    """The tokens whose keys and values the entry holds, in order."""
    layers: tuple[tuple[torch.Tensor, torch.Tensor], ...]
    """Per layer, keys and values of shape (heads, len(ids), head_dim)."""


@dataclass(frozen=True)
class Hit:
    """A row whose prompt starts with a cached prefix."""

    row: Any
    """The :class:`~agentloop_engines.adapters.hf.batch.Row` to prefill."""
    reused: int
    """How many prompt tokens come from the cache (at least 1, less than the prompt)."""
    layers: tuple[tuple[torch.Tensor, torch.Tensor], ...]
    """Per layer, the cached keys and values of those tokens: (heads, reused, head_dim)."""


class PrefixCache:
    """Per-trajectory KV entries, bounded by ``max_tokens`` in all, least recently used evicted.

    Args:
        max_tokens: Most tokens held over all entries (an entry longer than this is not kept).
        stats: The server's counters; this cache increments :attr:`STAT_KEYS` in it.
    """

    STAT_KEYS: ClassVar[tuple[str, ...]] = ("prefix_cache_hits", "prefix_cache_misses", "prefix_cache_tokens_reused",
                                            "prefix_cache_evictions", "prefix_cache_forgotten")
    """The counters this cache adds to ``HFServer.stats``."""

    def __init__(self, max_tokens: int, stats: dict[str, int]) -> None:
        if max_tokens < 1:
            raise ValueError(f"prefix_cache_tokens must be >= 1, got {max_tokens}; to turn the cache off pass "
                             "enable_prefix_caching=False")
        self.max_tokens = int(max_tokens)
        self.stats = stats
        self.tokens = 0
        """Tokens held now, over all entries."""
        self._entries: collections.OrderedDict[str, _Entry] = collections.OrderedDict()
        # clear() may come from another thread than the engine's, which stores and takes.
        self._lock = threading.Lock()

    @classmethod
    def for_model(cls, model: Any, enable: bool, max_tokens: int | None, stats: dict[str, int]) -> PrefixCache | None:
        """HFServer's cache for ``model`` (None when ``enable`` is False); ``max_tokens`` None:
        as many tokens as :data:`DEFAULT_PREFIX_CACHE_BYTES` of its keys and values hold.

        Raises:
            ValueError: a bound is given with ``enable`` False, or is below 1.
        """
        if not enable:
            if max_tokens is not None:
                raise ValueError(f"prefix_cache_tokens={max_tokens} with enable_prefix_caching=False: drop the bound, "
                                 "or turn the cache on")
            return None
        return cls(max_tokens if max_tokens is not None else max(1, DEFAULT_PREFIX_CACHE_BYTES // kv_bytes_per_token(model)),
                   stats)

    def __len__(self) -> int:
        return len(self._entries)

    def take(self, row: Any) -> Hit | None:
        """Remove ``row.request_id``'s entry and return what of it the row's prompt starts with
        (None: a miss, the row prefills cold)."""
        if row.images:
            return None
        with self._lock:
            entry = self._entries.pop(row.request_id, None)
            if entry is not None:
                self.tokens -= len(entry.ids)
        prompt = row.prompt_ids
        reused = 0
        # Leave at least one prompt token to compute: its logits pick the first new token.
        limit = min(len(entry.ids), len(prompt) - 1) if entry is not None else 0
        while entry is not None and reused < limit and entry.ids[reused] == prompt[reused]:
            reused += 1
        if entry is None or reused == 0:
            self.stats["prefix_cache_misses"] += 1
            return None
        self.stats["prefix_cache_hits"] += 1
        self.stats["prefix_cache_tokens_reused"] += reused
        return Hit(row, reused, tuple((k[:, :reused], v[:, :reused]) for k, v in entry.layers))

    def store(self, rows: list[Any], cache: Any, mask: torch.Tensor, indices: list[int]) -> None:
        """Keep the keys and values of the rows at ``indices`` of a decode batch that just
        finished (by stop or length): the slots ``mask`` marks real, in order."""
        layers = getattr(cache, "layers", None) or ()
        if not layers or any(type(layer).__name__ not in ("DynamicLayer", "GrowingLayer") for layer in layers):
            return  # sliding-window or other layouts: no reuse (their slots are not one per token)
        for j in indices:
            row = rows[j]
            ids = (*row.prompt_ids, *row.token_ids[:-1])
            if row.images or not ids or len(ids) > self.max_tokens:
                continue
            slots = mask[j].nonzero().squeeze(-1)
            if slots.numel() != len(ids):
                continue  # a layout this cache does not know; storing it could not be exact
            kept = tuple((layer.keys[j].index_select(-2, slots), layer.values[j].index_select(-2, slots))
                         for layer in layers)
            self._put(row.request_id, _Entry(ids, kept))

    def _put(self, key: str, entry: _Entry) -> None:
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self.tokens -= len(old.ids)
            self._entries[key] = entry
            self.tokens += len(entry.ids)
            while self.tokens > self.max_tokens:
                _, evicted = self._entries.popitem(last=False)
                self.tokens -= len(evicted.ids)
                self.stats["prefix_cache_evictions"] += 1

    def hits_first(self, rows: list[Any]) -> list[Any]:
        """``rows`` reordered: those whose ``request_id`` has an entry first, each part in its
        order (the server admits trajectories' next turns before new prompts)."""
        hits: list[Any] = []
        rest: list[Any] = []
        with self._lock:
            for row in rows:
                (hits if row.request_id in self._entries else rest).append(row)
        return hits + rest

    def forget(self, request_id: str) -> None:
        """Drop ``request_id``'s entry (its trajectory is over; unknown ids are ignored)."""
        with self._lock:
            entry = self._entries.pop(request_id, None)
            if entry is not None:
                self.tokens -= len(entry.ids)
                self.stats["prefix_cache_forgotten"] += 1

    def clear(self) -> None:
        """Drop every entry (the weights changed, or the server sleeps)."""
        with self._lock:
            self._entries.clear()
            self.tokens = 0


def hit_inputs(hits: list[Hit], *, pad_id: int, device: torch.device) -> dict[str, Any]:
    """The forward arguments that prefill only the new tokens of ``hits``: each row's cached
    keys/values left-padded to the longest, then its new tokens left-padded to the longest;
    positions continue from each row's cached length, so every row sees what it would alone.

    Returns:
        ``input_ids``, ``attention_mask`` (cached part and new part), ``position_ids``,
        ``cache`` (a ``DynamicCache``), ``reused_width`` (cached slots per row) and ``next_pos``.
    """
    width_c = max(h.reused for h in hits)
    tails = [h.row.prompt_ids[h.reused :] for h in hits]
    width_n = max(map(len, tails))
    ids = torch.full((len(hits), width_n), pad_id, dtype=torch.long)
    mask = torch.zeros((len(hits), width_c + width_n), dtype=torch.long)
    positions = torch.zeros((len(hits), width_n), dtype=torch.long)
    for i, (h, tail) in enumerate(zip(hits, tails, strict=True)):
        ids[i, width_n - len(tail) :] = torch.tensor(tail, dtype=torch.long)
        mask[i, width_c - h.reused : width_c] = 1
        mask[i, width_c + width_n - len(tail) :] = 1
        positions[i, width_n - len(tail) :] = torch.arange(h.reused, h.reused + len(tail))
    layers = []
    for n in range(len(hits[0].layers)):
        keys = torch.stack([left_pad(h.layers[n][0], width_c) for h in hits]).to(device)
        values = torch.stack([left_pad(h.layers[n][1], width_c) for h in hits]).to(device)
        layers.append((keys, values))
    next_pos = torch.tensor([len(h.row.prompt_ids) for h in hits], device=device)
    return {"input_ids": ids.to(device), "attention_mask": mask.to(device), "position_ids": positions.to(device),
            "cache": DynamicCache(layers), "reused_width": width_c, "next_pos": next_pos}


FALLBACK_KV_BYTES_PER_TOKEN = 1 << 16
"""What :func:`kv_bytes_per_token` assumes for a model whose config does not give its layers and
heads (a caller's own model object): 64 KB a token, so the default bound is 16k tokens."""


def kv_bytes_per_token(model: Any) -> int:
    """Bytes of keys and values one token takes in ``model``'s cache (every layer, in the
    model's dtype); :data:`FALLBACK_KV_BYTES_PER_TOKEN` when its config does not say."""
    try:
        config = text_config(model)
        heads = int(config.num_attention_heads)
        kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
        head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
        per_token = 2 * int(config.num_hidden_layers) * kv_heads * head_dim * next(model.parameters()).element_size()
    except (AttributeError, TypeError, ValueError, ZeroDivisionError, StopIteration):
        return FALLBACK_KV_BYTES_PER_TOKEN
    return per_token if per_token > 0 else FALLBACK_KV_BYTES_PER_TOKEN
