"""A KV cache layer that writes each decode step in place.

transformers' ``DynamicLayer`` appends a step's keys and values with ``torch.cat``: a new
tensor, and a copy of the whole cache, per layer, per step (a 16-row batch of ~330-token
SmolLM2 rows copies ~240 MB a step, and a fresh allocation of that size costs page faults on
top). :class:`GrowingLayer` keeps them at the front of a buffer with room along the sequence
axis and hands attention views of the filled part; the buffer grows by a quarter (at least
:data:`GROW_TOKENS` tokens) when full. Anything that replaces the tensors (dropping finished
rows, merging batches, repeating a shared prefix) goes through the same ``keys``/``values``
attributes as before and simply starts a new buffer.
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

    def set(self, tensor: Any) -> None:
        self.buffer = tensor
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
            self.buffer = grown
        self.buffer[:, :, self.length : need] = new
        self.length = need
        return self.view()


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
