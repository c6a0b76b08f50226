"""The policy's float32 linear layers on CPU through oneDNN, forward and backward.

torch's CPU wheels run ``linear`` and its gradients on MKL's sgemm, which on AMD EPYC (these
machines) reaches under half of what oneDNN does on the same core: a SmolLM2-sized layer's
forward + backward at 2304 tokens measured 84-100 vs 152-209 GFLOP/s on one thread, the
gradients equal to ~1e-6 relative. :class:`OneDNNLinear` computes ``y = x W^T + b``,
``dx = dy W`` and ``dW = dy^T x`` with ``torch.ops.mkldnn._linear_pointwise`` (no packing:
the weights change every step). It is ``model.cpu_matmul: onednn`` (the default);
``torch`` keeps torch's own.

A layer takes the oneDNN path only for plain CPU float32 tensors outside autocast; a sharded
parameter that is still a DTensor, another dtype or device, a forward under ``torch.autocast``
(mixed precision: autocast's bfloat16 kernels make the product, as configured), or a torch
without oneDNN runs ``nn.Linear``'s own forward.
"""

from __future__ import annotations

from typing import Any

import torch

from agentloop_engines.adapters.hf.packed_linear import onednn_linear as _mm
from agentloop_engines.adapters.hf.packed_linear import onednn_linear_works as onednn_works

__all__ = ["OneDNNLinear", "onednn_works", "use_onednn_linears"]

class _Function(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return _mm(x, weight, bias)

    @staticmethod
    def backward(ctx: Any, *grad_outputs: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        (grad,) = grad_outputs  # one output, one gradient
        x, weight = ctx.saved_tensors
        rows = grad.reshape(-1, grad.shape[-1])
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = _mm(rows, weight.t()).reshape(*grad.shape[:-1], weight.shape[1])
        if ctx.needs_input_grad[1]:
            grad_w = _mm(rows.t(), x.reshape(-1, x.shape[-1]).t())
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = rows.sum(0)
        return grad_x, grad_w, grad_b


class OneDNNLinear(torch.nn.Linear):
    """``nn.Linear`` whose CPU float32 products (and their gradients) run on oneDNN."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # noqa: A002 - nn.Linear's name
        weight, bias = self.weight, self.bias
        plain = (torch.Tensor, torch.nn.Parameter)
        if (type(input) is not torch.Tensor or type(weight) not in plain or (bias is not None and type(bias) not in plain)
                or input.device.type != "cpu" or weight.device.type != "cpu"
                or input.dtype != torch.float32 or weight.dtype != torch.float32 or input.shape[-1] == 0
                or torch.is_autocast_enabled("cpu")):
            # Under CPU autocast (model.dtype=bfloat16 on one process) the product is autocast's
            # to make, in its dtype: a float32 one would be other numerics, and slower here
            # (bfloat16 ~450 vs oneDNN float32 ~240 GFLOP/s for a layer's forward + backward).
            return super().forward(input)
        if torch.is_grad_enabled() and (input.requires_grad or weight.requires_grad
                                        or (bias is not None and bias.requires_grad)):
            return _Function.apply(input, weight, bias)
        return _mm(input, weight, bias)


def use_onednn_linears(model: Any) -> int:
    """Turn every plain ``nn.Linear`` of ``model`` into a :class:`OneDNNLinear` (same
    parameters, same state dict; each call still checks it is on the CPU in float32).

    Returns:
        How many layers were turned (0 without a working oneDNN).
    """
    if not onednn_works():
        return 0
    turned = 0
    for module in model.modules():
        if type(module) is torch.nn.Linear:
            module.__class__ = OneDNNLinear
            turned += 1
    return turned
