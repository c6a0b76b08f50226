"""A prefix every row of an optimizer step shares, run once for the whole step.

:func:`~agentloop_trainer.update.forward.sequence_log_probs` runs the rows' common prefix once
per call. A step split into micro-batches (``sft.micro_batch_size``,
``ppo_micro_batch_size_per_gpu``, which bound the memory of the activations) called it once per
micro-batch, so the system turn and tool schemas (210 of ~310 tokens of a calculator
demonstration with SmolLM2's tokenizer) went through the model once per micro-batch: on the
real-model recipe's SFT step (16 conversations in micro-batches of 4) 840 of its ~2450 tokens.

:class:`StepPrefix` runs the prefix once, with gradients, and hands each micro-batch a key/value
cache built from *detached* float32 copies of its keys and values. Each micro-batch's backward
stops at those copies and adds its gradient there; :meth:`StepPrefix.backward` then sends the
sum through the prefix's one forward. The parameters' gradients are those of the micro-batches
each running the prefix (the chain rule is linear in the cache's gradient), in one backward of
the prefix instead of one per micro-batch. The copies are float32 so that the micro-batches'
gradients add up in float32 under bfloat16 autocast, as the parameters' own gradients do.

One process only: which rows share what depends on the data, and FSDP ranks must make the same
collective calls.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any


class StepPrefix:
    """The key/value cache of ``ids`` under ``model``, computed once and reused by every
    micro-batch of a step (:meth:`cache`), its gradient sent back once (:meth:`backward`).

    Build it with :meth:`build`, which returns None where this transformers' cache does not
    expose its layers' tensors (the caller then runs the prefix per micro-batch, as before).
    """

    def __init__(self, cache: Any, ids: Sequence[int]) -> None:
        self._cache = cache
        self.ids = tuple(ids)
        self.length = len(self.ids)
        self._sources = [(layer.keys, layer.values) for layer in cache.layers]
        # float32 leaves: the micro-batches' gradients accumulate in float32.
        self._leaves = [(k.detach().float().requires_grad_(k.requires_grad),
                         v.detach().float().requires_grad_(v.requires_grad)) for k, v in self._sources]

    @classmethod
    def build(cls, model: Any, ids: Sequence[int], device: Any = None) -> StepPrefix | None:
        """Run ``ids`` (one row) through ``model`` and keep its cache; None when the cache has no
        ``layers`` with ``keys`` and ``values`` (an older transformers' cache) or is empty."""
        import torch

        if len(ids) < 1:
            raise ValueError("StepPrefix needs at least one token")
        device = device if device is not None else next(model.parameters()).device
        out = model(input_ids=torch.tensor([list(ids)], device=device), use_cache=True, logits_to_keep=1)
        cache = getattr(out, "cache", None) or out.past_key_values
        layers = getattr(cache, "layers", None)
        if not layers or any(getattr(layer, "keys", None) is None or getattr(layer, "values", None) is None
                             for layer in layers):
            return None
        return cls(cache, ids)

    def cache(self, batch: int) -> Any:
        """A fresh cache of the prefix for ``batch`` rows (each micro-batch needs its own: a
        forward appends to the cache it is given)."""
        fresh = copy.copy(self._cache)
        fresh.layers = []
        for layer, (k_src, v_src), (k, v) in zip(self._cache.layers, self._sources, self._leaves, strict=True):
            mine = copy.copy(layer)
            mine.keys = k.to(k_src.dtype).expand(batch, -1, -1, -1)
            mine.values = v.to(v_src.dtype).expand(batch, -1, -1, -1)
            fresh.layers.append(mine)
        return fresh

    def backward(self) -> None:
        """Send the micro-batches' summed gradient through the prefix's forward (once, after the
        last micro-batch's backward). Without any gradient (no micro-batch reached the prefix)
        there is nothing to send."""
        import torch

        outputs, grads = [], []
        for pair, leaves in zip(self._sources, self._leaves, strict=True):
            for source, leaf in zip(pair, leaves, strict=True):
                if leaf.grad is not None and source.requires_grad:
                    outputs.append(source)
                    grads.append(leaf.grad.to(source.dtype))
        if outputs:
            torch.autograd.backward(outputs, grads)
