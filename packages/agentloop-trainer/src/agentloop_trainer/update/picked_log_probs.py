"""Each position's log-prob of its target token, computed in float32 a few rows at a time.

The plain way (``logits[:, :-1].float() / T``, then ``gather`` minus ``logsumexp``) writes the
``[rows, positions, vocabulary]`` logits out again in float32 at every step: the cast, the
temperature's division, ``logsumexp``'s saved input, and in the backward ``exp(x - lse)``, its
product with the incoming gradient, the zeros ``gather``'s backward scatters into, their sum and
the cast back. On SmolLM2 (vocabulary 49152) a micro-batch of 8 rows of ~150 positions makes
each of these a fresh 236 MB block; on a CPU that is memory traffic and page faults, not
arithmetic (a GRPO update at ``bench_step_prefix``'s shape ran in 0.77x the time without it,
``bench/bench_picked_log_probs.py``).

:class:`PickedLogProbs` does the same arithmetic on ``CHUNK_BYTES`` of rows at a time: the
forward keeps only the logits (in their own dtype, which the graph holds anyway) and one
float32 log-normaliser per position; the backward recomputes each chunk's softmax and writes the
gradient ``(onehot - softmax) * g / T`` straight into one buffer of the logits' dtype. Same
values as the plain way (the same float32 operations row by row), gradients included
(``tests/test_picked_log_probs.py``).
"""

from __future__ import annotations

from typing import Any

CHUNK_BYTES = 4 << 20
"""float32 bytes of logits one chunk converts at a time (21 positions of SmolLM2's vocabulary;
whole rows of a small one)."""


def _chunks(B: int, n: int, V: int) -> list[tuple[slice, slice]]:
    """``(rows, positions)`` slices covering ``[B, n]`` with about ``CHUNK_BYTES`` of float32
    logits each: whole rows together when a row fits (a small vocabulary), else a row's
    positions a few at a time."""
    per_position = 4 * max(1, V)
    if n * per_position <= CHUNK_BYTES:
        rows = max(1, CHUNK_BYTES // max(1, n * per_position))
        return [(slice(b, min(B, b + rows)), slice(0, n)) for b in range(0, B, rows)]
    step = max(1, CHUNK_BYTES // per_position)
    return [(slice(b, b + 1), slice(i, min(n, i + step))) for b in range(B) for i in range(0, n, step)]


def _float_chunk(rows: Any, temperature: float) -> Any:
    """A float32 copy of ``rows`` (never the caller's tensor itself), divided by ``temperature``."""
    import torch

    x = rows.to(torch.float32, copy=True)
    if temperature != 1.0:
        x.div_(temperature)
    return x


def _make_function() -> Any:
    import torch

    class PickedLogProbs(torch.autograd.Function):
        """``log_softmax(logits[:, :n] / temperature)`` at ``targets`` (``[B, n]``), ``n`` the
        targets' length: positions of ``logits`` past it are not scored (get no gradient)."""

        @staticmethod
        def forward(ctx: Any, logits: Any, targets: Any, temperature: float) -> Any:
            B, n, V = targets.shape[0], targets.shape[1], logits.shape[-1]
            out = torch.empty((B, n), dtype=torch.float32, device=logits.device)
            lse = torch.empty((B, n), dtype=torch.float32, device=logits.device)
            for rows, cols in _chunks(B, n, V):
                x = _float_chunk(logits[rows, cols], temperature)
                norm = torch.logsumexp(x, dim=-1)
                out[rows, cols] = x.gather(-1, targets[rows, cols].unsqueeze(-1)).squeeze(-1) - norm
                lse[rows, cols] = norm
            ctx.save_for_backward(logits, targets, lse)
            ctx.temperature = temperature
            return out

        @staticmethod
        def backward(ctx: Any, *grads: Any) -> Any:
            (grad_out,) = grads
            logits, targets, lse = ctx.saved_tensors
            temperature = ctx.temperature
            B, n, V = targets.shape[0], targets.shape[1], logits.shape[-1]
            grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
            if logits.shape[1] > n:
                grad[:, n:].zero_()
            for rows, cols in _chunks(B, n, V):
                g = grad_out[rows, cols].to(torch.float32).unsqueeze(-1)
                x = _float_chunk(logits[rows, cols], temperature)
                x.sub_(lse[rows, cols].unsqueeze(-1)).exp_().mul_(g.neg())  # -g * softmax
                x.scatter_add_(-1, targets[rows, cols].unsqueeze(-1), g)  # + g at the target
                if temperature != 1.0:
                    x.div_(temperature)
                grad[rows, cols] = x
            return grad, None, None

    return PickedLogProbs


_FUNCTION: Any = None


def picked_log_probs(logits: Any, targets: Any, temperature: float = 1.0) -> Any:
    """``log_softmax(logits / temperature)`` at each target, in float32, chunk by chunk.

    Args:
        logits: ``[B, L, V]`` or ``[L, V]`` logits of any float dtype (a bfloat16 model's under
            autocast stays bfloat16: each chunk is converted on its own).
        targets: ``[B, n]`` or ``[n]`` long ids, ``n <= L``: position ``j`` scores
            ``targets[..., j]``; positions ``n..L-1`` (a causal model's last, which predicts
            nothing) are not scored.
        temperature: The sampling temperature the logits are divided by.

    Returns:
        ``[B, n]`` or ``[n]`` float32 log-probs, differentiable with respect to ``logits``.
    """
    global _FUNCTION
    if _FUNCTION is None:
        _FUNCTION = _make_function()
    flat = targets.dim() == 1
    if flat:
        logits, targets = logits.unsqueeze(0), targets.unsqueeze(0)
    if targets.shape[1] > logits.shape[1]:
        raise ValueError(f"{targets.shape[1]} targets for {logits.shape[1]} positions of logits")
    out = _FUNCTION.apply(logits, targets, float(temperature or 1.0))
    return out[0] if flat else out
