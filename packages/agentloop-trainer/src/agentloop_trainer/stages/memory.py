"""The training process's host memory: its peak as a metric, the heap handed back between
phases (rollout, update, evaluation) on a CPU trainer, where all three share the host's RAM,
and large blocks kept off the heap within a phase.

Without the hand-back a CPU process stays at the sum of its phases' peaks: glibc keeps what
each phase freed, in the arena of the thread that allocated it (the engine's decode thread,
the update's main thread); see :mod:`agentloop_core.runtime.host_memory`.
"""

from __future__ import annotations

from typing import Any

from agentloop_core.runtime.host_memory import map_large_blocks, release_host_memory
from agentloop_trainer.config.sections import TrainerSection

__all__ = ["end_of_phase", "map_large_host_blocks", "peak_memory_metrics"]


def map_large_host_blocks(trainer: TrainerSection) -> bool:
    """Fix glibc's mmap threshold at ``trainer.host_mmap_threshold_mb`` for this process on a
    CPU trainer (``trainer.device``); returns whether it was set."""
    if trainer.device != "cpu" or trainer.host_mmap_threshold_mb is None:
        return False
    return map_large_blocks(trainer.host_mmap_threshold_mb << 20)


def end_of_phase(device: Any) -> None:
    """Hand the heap a phase freed back to the OS before the next phase runs, on a CPU trainer
    (on an accelerator the phases' tensors are not on the host heap: nothing to gain)."""
    if device.type == "cpu":
        release_host_memory()


def peak_memory_metrics(device: Any) -> dict[str, float]:
    """Peak memory so far: the accelerator's (reset each step) on CUDA, the process's on CPU."""
    if device.type == "cuda":
        import torch

        peak = torch.cuda.max_memory_allocated(device) / 2**20
        torch.cuda.reset_peak_memory_stats(device)
        return {"perf/max_memory_allocated_mb": peak}
    import resource

    return {"perf/max_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
