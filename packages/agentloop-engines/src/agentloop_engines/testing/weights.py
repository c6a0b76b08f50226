"""Weights for tests of in-place weight updates: a checkpoint's state dict and a perturbed copy."""

from __future__ import annotations

from typing import Any


def perturbed_weights(model_path: Any, scale: float = 0.05, seed: int = 1234) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(old, new)`` state dicts of the checkpoint at ``model_path`` (float32), ``new`` being
    ``old`` plus ``scale`` x N(0, 1) noise from ``seed``.

    Tensors the model ties together (an ``lm_head`` sharing the embedding's storage) get one
    perturbed value in ``new``: two different values for one tensor would leave it to load
    order which one an engine keeps.
    """
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch.float32)
    state = model.state_dict()
    old = {k: v.detach().clone() for k, v in state.items()}
    gen = torch.Generator().manual_seed(seed)
    new: dict[str, Any] = {}
    first_of: dict[int, str] = {}  # storage -> the first key holding it
    for key, value in state.items():
        owner = first_of.setdefault(value.untyped_storage().data_ptr(), key)
        new[key] = new[owner] if owner != key else old[key] + scale * torch.randn(value.shape, generator=gen)
    return old, new
