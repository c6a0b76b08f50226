"""Loading on-policy distillation's teacher (``distillation``) for a run: its vocab checked
against the student's, the model frozen like the KL reference (sharded when the policy is), and
the :class:`~agentloop_trainer.update.distill.Distiller` around it. Here rather than in
``update/`` because loading reaches the policy room (its CPU matmul choice), which itself
builds on ``update/``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from agentloop_engines.adapters.hf.vision import load_model
from agentloop_trainer.config.sections import ModelSection
from agentloop_trainer.policy.model import use_cpu_matmul
from agentloop_trainer.update.distill import Distiller, check_same_vocab
from agentloop_trainer.update.distill_settings import DistillationSection
from agentloop_trainer.update.fsdp import load_reference

__all__ = ["build_distiller", "load_teacher"]


def build_distiller(section: DistillationSection, model: ModelSection, tokenizer: Any,
                    student_path: str | Path | None, *, sharded: bool, device: Any) -> Distiller | None:
    """The run's distiller (None when ``distillation.enabled`` is false): checks the teacher's
    vocab against the student's, then loads it frozen (sharded when the policy is).

    Raises:
        ValueError: enabled without ``distillation.teacher_model.model_path``.
        TeacherVocabError: the teacher's tokenizer is not the student's.
    """
    if not section.enabled:
        return None
    path = section.teacher_model.model_path
    if not path:
        raise ValueError("distillation.enabled=true needs distillation.teacher_model.model_path (a Hugging Face "
                         "folder with the student's tokenizer)")
    check_same_vocab(tokenizer, model.tokenizer_path or student_path or "the tiny model", path)
    teacher = load_teacher(path, device, model.dtype, sharded=sharded)
    use_cpu_matmul(teacher, model.cpu_matmul, str(device))
    return Distiller.from_section(section, teacher)


def load_teacher(path: str | Path, device: Any, dtype: str = "float32", *, sharded: bool = False) -> Any:
    """The teacher, frozen (``eval``, no grad): a plain float32 module on ``device``, or under
    FSDP sharded like the policy (every rank holds a shard; a forward gathers layer by layer)."""
    import torch

    if sharded:
        return load_reference(path, str(device), dtype)
    return load_model(str(path), torch.float32).eval().requires_grad_(False).to(device)
