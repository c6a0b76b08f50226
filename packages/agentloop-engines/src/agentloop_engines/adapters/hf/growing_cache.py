"""A KV cache layer that writes each decode step in place.

transformers' ``DynamicLayer`` appends a step's keys and values with ``torch.cat``: a new
tensor, and a copy of the whole cache, per layer, per step (a 16-row batch of ~330-token
SmolLM2 rows copies ~240 MB a step, and a fresh allocation of that size costs page faults on
top). :class:`GrowingLayer` keeps them at the front of a buffer with room along the sequence
axis and hands attention views of the filled part; the buffer grows by a quarter (at least
:data:`GROW_TOKENS` tokens) when full. Anything else that replaces the tensors (repeating a
shared prefix, cropping) goes through the same ``keys``/``values`` attributes as before and
simply starts a new buffer.

Rows that finish are dropped in place (:meth:`GrowingLayer.batch_select_indices`: the last
live rows move into the finished rows' places, only they are copied, and the room is kept), and
a merge writes both batches, left-padded, straight into one new buffer with room
(:func:`merge_layers`). Before, each drop made a gathered copy of the whole cache with no room,
which the next step copied again into a grown buffer, and each merge padded copies and
concatenated them: on a CPU, 60 new tensors of 16-33 MB (128 SmolLM2 rows of ~300 tokens, just
under the 32 MB up to which glibc serves blocks from its heap) at each of those steps, each size
a little off the last, so each generation left the heap holes the next could not fill (a
held-out evaluation of the real-model recipe held 7.7-8.7 GB resident for 3.9 GB in use; now
5.1-6.4 GB, bench/README 10g). Giving each buffer a mapping of its own was tried as well: the
resident set was the same and the evaluation took 16% longer (fresh pages fault in).
"""

from __future__ import annotations

from typing import Any

import torch

GROW_TOKENS = 64
"""Least room added along the sequence axis when a buffer is full."""


def _layer_base() -> type:
    from transformers.cache_utils import DynamicLayer

    return DynamicLayer


class _Slot:
    """One of a layer's two tensors: a buffer (batch, heads, capacity, dim) and how much of its
    sequence axis is filled."""

    __slots__ = ("buffer", "length")

    def __init__(self, tensor: Any) -> None:
        self.set(tensor)

    def set(self, tensor: Any, length: int | None = None) -> None:
        self.buffer = tensor
        if length is not None:
            self.length = length
        else:
            self.length = tensor.shape[-2] if isinstance(tensor, torch.Tensor) and tensor.dim() == 4 else None

    def view(self) -> Any:
        if self.length is None or self.length == self.buffer.shape[-2]:
            return self.buffer
        return self.buffer[:, :, : self.length]

    def append(self, new: torch.Tensor) -> torch.Tensor:
        if self.length is None or self.buffer.numel() == 0:
            self.set(new)
            return new
        old, need = self.buffer, self.length + new.shape[-2]
        if need > old.shape[-2] or old.shape[:2] != new.shape[:2] or old.shape[-1] != new.shape[-1]:
            if old.shape[:2] != new.shape[:2] or old.shape[-1] != new.shape[-1]:
                # A shape the cache was not built for: cat gives transformers' own error.
                self.set(torch.cat([self.view(), new], dim=-2))
                return self.buffer
            room = max(GROW_TOKENS, need // 4)
            grown = old.new_empty((*old.shape[:2], need + room, old.shape[-1]))
            grown[:, :, : self.length] = self.view()
            self.set(grown, self.length)
        self.buffer[:, :, self.length : need] = new
        self.length = need
        return self.view()

    def keep_rows(self, order: list[int]) -> None:
        """Keep the rows ``order`` names, in that order. When each row moves down or stays
        (``order[i] >= i``, as when finished rows are dropped) they move within the buffer;
        otherwise the rows are gathered into a new buffer with the same room, at least
        :data:`GROW_TOKENS` (a prefill's cache has none, and its first decode step would copy it
        again)."""
        if self.length is None or self.buffer.numel() == 0:
            self.set(self.buffer[order])
            return
        buffer, length = self.buffer, self.length
        if all(j >= i for i, j in enumerate(order)):
            for i, j in enumerate(order):  # a row is read before any write reaches it
                if i != j:
                    buffer[i, :, :length].copy_(buffer[j, :, :length])
            self.buffer = buffer[: len(order)]
            return
        capacity = max(buffer.shape[-2], length + GROW_TOKENS)
        gathered = buffer.new_empty((len(order), buffer.shape[1], capacity, buffer.shape[-1]))
        torch.index_select(self.view(), 0, torch.tensor(order, device=buffer.device), out=gathered[:, :, :length])
        self.set(gathered, length)

    def join(self, theirs: torch.Tensor, width: int) -> None:
        """Hold this slot's rows then ``theirs``, each left-padded with zeros to ``width``
        positions, in one new buffer with :data:`GROW_TOKENS` of room."""
        mine = self.view()
        rows = mine.shape[0] + theirs.shape[0]
        joined = mine.new_empty((rows, mine.shape[1], width + GROW_TOKENS, mine.shape[-1]))
        for part, lo, hi in ((mine, 0, mine.shape[0]), (theirs, mine.shape[0], rows)):
            pad = width - part.shape[-2]
            if pad:
                joined[lo:hi, :, :pad].zero_()
            joined[lo:hi, :, pad:width] = part
        self.set(joined, width)


def growing_layer_class() -> type:
    """:class:`GrowingLayer`, built on this transformers' ``DynamicLayer`` (imported lazily)."""
    global _GROWING
    if _GROWING is None:
        base = _layer_base()

        class GrowingLayer(base):  # type: ignore[misc, valid-type]
            """``DynamicLayer`` whose appends write into spare room instead of concatenating."""

            @property
            def keys(self) -> Any:
                slot = self.__dict__.get("_k")
                return None if slot is None else slot.view()

            @keys.setter
            def keys(self, tensor: Any) -> None:
                self.__dict__["_k"] = _Slot(tensor)

            @property
            def values(self) -> Any:
                slot = self.__dict__.get("_v")
                return None if slot is None else slot.view()

            @values.setter
            def values(self, tensor: Any) -> None:
                self.__dict__["_v"] = _Slot(tensor)

            def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
                       **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
                if not self.is_initialized:  # never after grow_in_place; kept for safety
                    return super().update(key_states, value_states, *args, **kwargs)
                return self.__dict__["_k"].append(key_states), self.__dict__["_v"].append(value_states)

            def batch_select_indices(self, indices: torch.Tensor) -> None:
                """Keep the rows ``indices`` names, in place when they only move down."""
                if self.get_seq_length() > 0:
                    order = indices.tolist()
                    self.__dict__["_k"].keep_rows(order)
                    self.__dict__["_v"].keep_rows(order)

            def join(self, other: Any, width: int) -> None:
                """Append ``other``'s rows (any full-attention layer), both left-padded to ``width``."""
                self.__dict__["_k"].join(other.keys, width)
                self.__dict__["_v"].join(other.values, width)

        _GROWING = GrowingLayer
    return _GROWING


_GROWING: type | None = None


def grow_in_place(cache: Any) -> int:
    """Turn every plain ``DynamicLayer`` of ``cache`` into a :class:`GrowingLayer`, keeping its
    tensors; other layer types (sliding window, quantized, static) are left alone.

    Returns:
        How many layers were turned.
    """
    base, growing = _layer_base(), growing_layer_class()
    turned = 0
    for layer in getattr(cache, "layers", None) or ():
        if type(layer) is not base or not getattr(layer, "is_initialized", False):
            continue
        keys, values = layer.__dict__.pop("keys", None), layer.__dict__.pop("values", None)
        layer.__class__ = growing
        layer.keys, layer.values = keys, values
        turned += 1
    return turned


def merge_layers(mine: Any, theirs: Any, width: int) -> None:
    """Give layer ``mine`` the rows of ``theirs`` after its own, both left-padded with masked
    zeros to ``width`` positions: in one new buffer when ``mine`` is a growing layer, by
    concatenation otherwise."""
    if isinstance(mine, growing_layer_class()):
        mine.join(theirs, width)
        return
    mine.keys = torch.cat([left_pad(mine.keys, width), left_pad(theirs.keys, width)])
    mine.values = torch.cat([left_pad(mine.values, width), left_pad(theirs.values, width)])


def left_pad(t: torch.Tensor, width: int, dim: int = -2) -> torch.Tensor:
    """``t`` with zeros before it along ``dim`` up to ``width`` (``t`` itself when already that wide)."""
    missing = width - t.shape[dim]
    if missing == 0:
        return t
    shape = list(t.shape)
    shape[dim] = missing
    return torch.cat([t.new_zeros(shape), t], dim=dim)
