"""Which compute dtype the policy trains in: ``model.dtype=auto`` resolved for the device, and a
notice when an explicit ``bfloat16`` lands on a CPU that has no bfloat16 arithmetic.

bfloat16 mixed precision pays only where the hardware multiplies bfloat16 natively. On an Intel
Xeon with AVX512_BF16 a SmolLM2 layer's forward and backward ran 453 GFLOP/s under autocast
against 242 in oneDNN float32 (bench/README 10b); on a 2-core AMD EPYC with AVX2 only, where
torch has no fast bfloat16 kernel, a SmolLM2-shaped training step ran 32.9x *slower* under
autocast than in float32 (``python bench/bench_cpu_dtype.py``). A recipe that hard-codes
bfloat16 for speed on one machine is then unusable on the next, so the shipped recipes say
``auto``.
"""

from __future__ import annotations

import platform
from collections.abc import Callable

AUTO = "auto"
"""``model.dtype`` value resolved here, once, when the config is loaded."""


def cpu_has_native_bf16() -> bool:
    """Whether this CPU multiplies bfloat16 in hardware: x86 AVX512_BF16 or AMX tiles, or an
    Arm CPU whose bfloat16 extension oneDNN uses. AVX-512 without its bfloat16 extension is not
    counted: bfloat16 is emulated there (not measured here; float32 is the safe side)."""
    import torch

    probes = [getattr(torch.cpu, "_is_avx512_bf16_supported", None), getattr(torch.cpu, "_is_amx_tile_supported", None)]
    if any(probe is not None and probe() for probe in probes):
        return True
    if platform.machine().lower() in ("aarch64", "arm64"):
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return False


def bf16_is_native(device: str) -> bool:
    """Whether ``device`` (``trainer.device``: ``cpu``, ``cuda``, ``cuda:1``...) computes
    bfloat16 natively: a CUDA GPU of compute capability 8.0 or later (not emulated), or a CPU per
    :func:`cpu_has_native_bf16`. Where this process sees no CUDA GPU (a Ray driver whose ranks
    hold the GPUs) a CUDA device is taken to have it, as every GPU since Ampere does. Other
    device types: False (float32 is the safe choice there)."""
    import torch

    kind = torch.device(device).type
    if kind == "cuda":
        if not torch.cuda.is_available():
            return True
        return bool(torch.cuda.is_bf16_supported(including_emulation=False))
    if kind == "cpu":
        return cpu_has_native_bf16()
    return False


def resolve_dtype(dtype: str, device: str, notice: Callable[[str], None],
                  native: Callable[[str], bool] = bf16_is_native) -> str:
    """The concrete ``model.dtype`` to train in.

    Args:
        dtype: ``model.dtype``: ``auto``, ``float32`` or ``bfloat16``.
        device: ``trainer.device``.
        notice: Receives one line when the choice is worth a word: what ``auto`` picked on a
            device without native bfloat16, or an explicit ``bfloat16`` on a CPU without it.
        native: Whether ``device`` computes bfloat16 natively (:func:`bf16_is_native`).

    Returns:
        ``bfloat16`` where ``auto`` meets native bfloat16, ``float32`` for ``auto`` elsewhere,
        and an explicit value unchanged (the user's choice of numerics is kept).
    """
    if dtype == AUTO:
        if native(device):
            return "bfloat16"
        notice(f"model.dtype=auto: float32 on {device} (no native bfloat16 here, where bfloat16 mixed "
               "precision runs slower than float32)")
        return "float32"
    if dtype == "bfloat16" and device.startswith("cpu") and not native(device):
        notice("model.dtype=bfloat16 on a CPU without native bfloat16 (no AVX512_BF16 or AMX): autocast "
               "runs many times slower than float32 here (32.9x for a SmolLM2-shaped step on AVX2, "
               "bench/bench_cpu_dtype.py); set model.dtype=auto or float32 unless bfloat16's numerics "
               "are the point")
    return dtype
