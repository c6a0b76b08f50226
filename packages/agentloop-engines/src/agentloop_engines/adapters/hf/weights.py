"""Loading new weights into a running HFServer's model, in place and all or nothing."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from agentloop_engines.adapters.weight_check import WeightSpec, check_weight_update, dtype_kind

__all__ = ["load_weights_in_place"]


def load_weights_in_place(model: Any, items: Iterable[tuple[str, Any]], *, engine: str) -> None:
    """Copy ``(name, tensor)`` pairs into ``model``'s ``state_dict`` tensors, each cast to its
    parameter's device and dtype. The whole update is checked first (every name, shape and
    dtype kind), so a refused one changes nothing.

    Raises:
        WeightUpdateError: naming every bad tensor (see :func:`check_weight_update`); nothing
            was loaded.
    """
    state = model.state_dict(keep_vars=True)
    specs = {name: WeightSpec(tuple(t.shape), dtype_kind(t.dtype)) for name, t in state.items()}
    pairs = [(name, _as_tensor(value)) for name, value in items]
    # All of it is checked before the first copy: a copy-as-you-go loop would leave the tensors
    # before a bad one changed, a model that is neither policy.
    pairs = check_weight_update(pairs, specs, engine=engine)
    with torch.no_grad():
        for name, tensor in pairs:
            target = state[name]
            target.copy_(tensor.to(device=target.device, dtype=target.dtype))


def _as_tensor(value: Any) -> Any:
    """``value`` as a tensor (lists and arrays are converted), or as it is when it cannot be
    one (a string), for :func:`check_weight_update` to name."""
    try:
        return torch.as_tensor(value)
    except (TypeError, ValueError, RuntimeError):
        return value
