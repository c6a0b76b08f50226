"""float32 linear layers on CPU through oneDNN with weights packed once.

torch's CPU ``linear``/``mm`` goes to MKL's sgemm, which on AMD EPYC (these machines) runs
less than half as fast as oneDNN on the same core: measured on one thread, 2048 x 2048 at ~95
vs ~220 GFLOP/s, and a decode step's skinny products (16 rows by 576 x 1536) at 77 vs 204
GFLOP/s once oneDNN has its weights in its own blocked layout. So an engine serving a CPU
float32 model packs each ``nn.Linear`` weight once (``torch.ops.mkldnn._reorder_linear_weight``)
and runs the layer with ``torch.ops.mkldnn._linear_pointwise``.

The packed copy is made again whenever the weight changes: an in-place update (``copy_``,
an optimizer step: the tensor's version counter moves) or a new tensor (its storage moves),
checked at every call. A write through ``weight.data`` moves neither; call :func:`repack`
after one. It costs one more copy of the linear weights in memory. Anything else (another
device or dtype, autograd on, a torch without oneDNN) runs the layer as before.
"""

from __future__ import annotations

import functools
import logging
import types
import weakref
from typing import Any

import torch

logger = logging.getLogger(__name__)

_ONEDNN: Any = torch.ops.mkldnn
"""torch's oneDNN operators (typed loosely: their stubs are generated at runtime)."""

# Per layer: (weight storage, version) -> its packed weight. Kept off the module, so a copy or a
# pickle of the model (deepcopy, torch.save) never meets oneDNN's opaque tensors.
_PACKED: weakref.WeakKeyDictionary[torch.nn.Module, tuple[tuple[int, int], Any]] = weakref.WeakKeyDictionary()


def _packed_forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    weight = self.weight
    if (x.device.type != "cpu" or x.dtype != torch.float32 or weight.dtype != torch.float32
            or weight.device.type != "cpu" or (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))):
        return torch.nn.functional.linear(x, weight, self.bias)
    packed = _PACKED.get(self)
    key = (weight.data_ptr(), weight._version)
    if packed is None or packed[0] != key:
        packed = _PACKED[self] = (key, _ONEDNN._reorder_linear_weight(
            weight.detach(), self.__dict__.get("_agentloop_rows", 64)))
    return onednn_linear(x, packed[1], self.bias)


def onednn_linear(x: torch.Tensor, weight: Any, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias`` by oneDNN (``weight`` plain or packed by ``_reorder_linear_weight``)."""
    return _ONEDNN._linear_pointwise(x, weight, bias, "none", [], "")


@functools.cache
def onednn_linear_works() -> bool:
    """Whether this torch runs oneDNN's linear, plain and packed, and gets what ``linear`` gets."""
    try:
        if not torch.backends.mkldnn.is_available():
            return False
        x, w, b = torch.randn(3, 8), torch.randn(5, 8), torch.randn(5)
        want = torch.nn.functional.linear(x, w, b)
        return all(bool(torch.allclose(onednn_linear(x, weight, b), want, atol=1e-4))
                   for weight in (w, _ONEDNN._reorder_linear_weight(w, 4)))
    except (AttributeError, RuntimeError, TypeError) as exc:
        logger.info("oneDNN linear unavailable (%s: %s); linear layers run on torch's own", type(exc).__name__, exc)
        return False


def pack_linears(model: Any, rows_hint: int = 64) -> int:
    """Run every plain ``nn.Linear`` of ``model`` through oneDNN with a packed weight (see the
    module doc); a model that is not on the CPU in float32 is left alone.

    Args:
        model: A ``torch.nn.Module``.
        rows_hint: The number of rows a call usually has (the engine's batch size), which
            oneDNN may pick its packed layout for; any number of rows works.

    Returns:
        How many layers were switched.
    """
    linears = [m for m in model.modules() if type(m) is torch.nn.Linear
               and m.weight.device.type == "cpu" and m.weight.dtype == torch.float32]
    if not linears or not onednn_linear_works():
        return 0
    for module in linears:
        module.__dict__["_agentloop_rows"] = max(1, int(rows_hint))
        _PACKED.pop(module, None)
        module.forward = types.MethodType(_packed_forward, module)
    return len(linears)


def repack(model: Any) -> None:
    """Drop the packed copies of ``model``'s switched layers (each is packed again at its next
    call): after writing weights through ``.data``, which the automatic check cannot see."""
    for module in model.modules():
        _PACKED.pop(module, None)
