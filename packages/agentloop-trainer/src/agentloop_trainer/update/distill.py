"""On-policy distillation (``distillation.enabled``): a frozen teacher scores every token the
student sampled, and the per-token reverse KL becomes the student's advantage.

The student samples ``x_t`` from ``p_student``; the teacher is run over the same token ids (one
forward pass, as the KL reference is) and gives ``log p_teacher(x_t)``. The per-token signal is
an estimate of the reverse KL ``KL(p_student || p_teacher)`` at that position, from the sampled
token alone (:data:`DISTILLATION_LOSSES`; ``k1``: ``log p_student(x_t) - log p_teacher(x_t)``),
and the token's advantage is ``-coef * kl_t`` (``use_task_rewards=false``: pure distillation,
the Thinking Machines / verl ``use_policy_gradient`` recipe), or the task's advantage plus it
(``use_task_rewards=true``). The PPO-clip policy gradient of that advantage is, in expectation,
the gradient of the reverse KL: mode-seeking, and on the student's own states, so it corrects
the mistakes the student actually makes.

**A baseline** (``distillation_loss.baseline``, :data:`DISTILLATION_BASELINES`). Almost every
sampled token has ``kl_t > 0`` (the student's own token is likelier under the student), so
with verl's signal (``none``, the default) nearly every advantage is negative and each update
pushes probability off the sampled tokens. A constant shifts no expected policy gradient, only
its noise: ``mean`` subtracts the batch's mean ``kl_t`` over its generated tokens, so tokens the
teacher likes more than average are pushed up and the rest down; ``whiten`` also divides by
their standard deviation (verl's ``masked_whiten``, as GAE's advantages are). The baseline is the
whole batch's on every FSDP rank (the log-probs are). On the tiny model neither changed the
curve much (docs/distillation.md): under Adam a per-step scale hardly matters, and the noise the
mean removes was not what made the student drift.

Only generated tokens (``response_mask`` 1) are scored: a tool result, a user turn or an image
placeholder (mask 0) was not sampled by the student, so the teacher's opinion of it is no
signal; those positions get 0.

Both log-probs come from the trainer's own forward code
(:meth:`~agentloop_trainer.update.actor.PolicyGradientActor.compute_log_probs`, at the rollout
temperature): the student's are the update's old log-probs, not the engine's, so a teacher with
the student's weights gives a signal of exactly 0 (no engine-vs-trainer gap leaks into it).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agentloop_trainer.config_base import require
from agentloop_trainer.update.distill_settings import DistillationLossSection, DistillationSection
from agentloop_trainer.update.losses import kl_k3, masked_mean
from agentloop_trainer.update.tables import AlgorithmTable

__all__ = [
    "DISTILLATION_BASELINES",
    "DISTILLATION_LOSSES",
    "DistillationLoss",
    "Distiller",
    "TeacherVocabError",
    "check_same_vocab",
    "distill_advantages",
    "kl_baseline",
    "register_distillation_loss",
    "token_kl",
]

Estimate = Callable[[Any, Any], Any]
"""``(student_log_probs, teacher_log_probs) -> per-token KL estimate``, all ``[B, R]``."""


@dataclass(frozen=True)
class DistillationLoss:
    """One row of :data:`DISTILLATION_LOSSES`."""

    name: str
    """The value of ``distillation.distillation_loss.loss_mode``."""
    estimate: Estimate
    """The per-token estimate (see :data:`Estimate`)."""
    verl_name: str | None = None
    """verl's name for it (None: verl has none)."""
    summary: str = ""
    """One line for docs and errors."""


DISTILLATION_LOSSES: AlgorithmTable[DistillationLoss] = AlgorithmTable(
    "distillation.distillation_loss.loss_mode", "agentloop.distillation_losses", DistillationLoss,
    "Register one with agentloop_trainer.update.distill.register_distillation_loss (see docs/distillation.md).",
)
"""Values of ``distillation.distillation_loss.loss_mode``: name -> :class:`DistillationLoss`."""


def register_distillation_loss(name: str, *, verl_name: str | None = None,
                               summary: str = "") -> Callable[[Estimate], Estimate]:
    """Decorator: add the function to :data:`DISTILLATION_LOSSES` under ``name``."""

    def register(estimate: Estimate) -> Estimate:
        DISTILLATION_LOSSES.add(name, DistillationLoss(name, estimate, verl_name, summary))
        return estimate

    return register


@register_distillation_loss("k1", verl_name="k1", summary="log p_student(x_t) - log p_teacher(x_t) on the sampled token")
def _k1(student: Any, teacher: Any) -> Any:
    return student - teacher


@register_distillation_loss("k3", verl_name="k3", summary="exp(-k1) - 1 + k1: non-negative, lower variance")
def _k3(student: Any, teacher: Any) -> Any:
    return kl_k3(student, teacher, clamp=None)


def token_kl(student_log_probs: Any, teacher_log_probs: Any, mask: Any, loss_mode: str = "k1", *,
             log_prob_min_clamp: float | None = None, loss_max_clamp: float | None = None) -> Any:
    """The per-token reverse-KL estimate, ``[B, R]``, 0 wherever ``mask`` is 0.

    Args:
        student_log_probs: ``[B, R]`` log-probs of the sampled tokens under the student.
        teacher_log_probs: ``[B, R]`` the same tokens under the teacher.
        mask: ``[B, R]`` 1 on generated tokens (the only ones scored).
        loss_mode: A name in :data:`DISTILLATION_LOSSES`.
        log_prob_min_clamp: Floor on both log-probs first (None: none).
        loss_max_clamp: Cap on ``|kl_t|`` (None: none).

    Raises:
        UnknownAlgorithmError: an unknown ``loss_mode``, listing the valid ones.
    """
    import torch

    estimate = DISTILLATION_LOSSES.get(loss_mode).estimate
    s, t = student_log_probs.float(), teacher_log_probs.float()
    if log_prob_min_clamp is not None:
        s, t = s.clamp(min=log_prob_min_clamp), t.clamp(min=log_prob_min_clamp)
    kl = estimate(s, t)
    if loss_max_clamp is not None:
        kl = kl.clamp(-loss_max_clamp, loss_max_clamp)
    # where, not a product: a masked position may hold -inf (a token the teacher cannot emit).
    return torch.where(mask.to(kl.device) > 0, kl, torch.zeros_like(kl))


DISTILLATION_BASELINES = ("mean", "whiten", "none")
"""Values of ``distillation.distillation_loss.baseline`` (see the module docstring)."""


def kl_baseline(kl: Any, mask: Any, baseline: str = "none") -> Any:
    """``kl`` less its baseline over the generated tokens (``mask`` 1), 0 off the mask.

    Args:
        kl: ``[B, R]`` per-token estimates (:func:`token_kl`).
        mask: ``[B, R]`` 1 on generated tokens.
        baseline: ``mean``: less the mean over the mask; ``whiten``: that, divided by the
            standard deviation; ``none``: ``kl`` as it is.

    Raises:
        ValueError: an unknown ``baseline``, naming the valid ones.
    """
    from agentloop_trainer.update.gae import masked_whiten

    if baseline not in DISTILLATION_BASELINES:
        raise ValueError(f"distillation.distillation_loss.baseline must be one of {DISTILLATION_BASELINES}, "
                         f"got {baseline!r}")
    mask = mask.to(kl.device, kl.dtype)
    if baseline == "whiten":
        return masked_whiten(kl, mask)
    if baseline == "mean":
        return (kl - masked_mean(kl, mask)) * mask
    return kl


def distill_advantages(kl: Any, coef: float, task_advantages: Any = None) -> Any:
    """``[B, R]`` advantages: ``-coef * kl`` per token (``kl`` with its baseline taken off:
    :func:`kl_baseline`), plus the task's (``[B]`` one per row, broadcast over its tokens, or
    ``[B, R]``) when given. ``kl`` is already 0 off the mask."""
    signal = -coef * kl
    if task_advantages is None:
        return signal
    task = task_advantages.to(signal.device, signal.dtype)
    return signal + (task[:, None] if task.dim() == 1 else task)


class TeacherVocabError(ValueError):
    """The teacher's tokenizer does not have the student's vocab (its scores would be of other tokens)."""


def check_same_vocab(student_tokenizer: Any, student_path: str | Path, teacher_path: str | Path,
                     teacher_tokenizer: Any = None) -> None:
    """Fail unless the teacher's tokenizer maps every token to the student's id.

    Raises:
        TeacherVocabError: naming both folders and the first tokens that differ.
    """
    if teacher_tokenizer is None:
        from transformers import AutoTokenizer

        try:
            teacher_tokenizer = AutoTokenizer.from_pretrained(str(teacher_path))
        except (OSError, ValueError) as exc:
            raise TeacherVocabError(
                f"distillation.teacher_model.model_path={teacher_path} has no tokenizer to check against the "
                f"student's ({student_path}): {exc}. Save the tokenizer into the teacher's folder") from None
    student, teacher = student_tokenizer.get_vocab(), teacher_tokenizer.get_vocab()
    if student == teacher:
        return
    only_student = sorted(set(student) - set(teacher))[:5]
    only_teacher = sorted(set(teacher) - set(student))[:5]
    moved = sorted(k for k in set(student) & set(teacher) if student[k] != teacher[k])[:5]
    raise TeacherVocabError(
        f"the teacher (distillation.teacher_model.model_path={teacher_path}) and the student "
        f"({student_path}) have different vocabularies ({len(teacher)} vs {len(student)} tokens; only the "
        f"student's: {only_student}; only the teacher's: {only_teacher}; other ids: {moved}). On-policy "
        "distillation scores the student's token ids under the teacher, so both need the same tokenizer: "
        "pick a teacher of the student's model family")


@dataclass
class Distiller:
    """The teacher and the signal's settings, applied to each batch by the trainer.

    Args:
        teacher: The frozen teacher module (sharded like the policy under FSDP).
        loss: ``distillation.distillation_loss``: the loss mode, coefficient, clamps, baseline
            and whether the task's advantage stays.
    """

    teacher: Any
    loss: DistillationLossSection = field(default_factory=DistillationLossSection)

    @classmethod
    def from_section(cls, section: DistillationSection, teacher: Any) -> Distiller:
        """The distiller of a ``distillation`` section around its loaded ``teacher``
        (:func:`agentloop_trainer.stages.teacher.build_distiller` loads it)."""
        return cls(teacher, section.distillation_loss)

    def apply(self, actor: Any, pb: Any, old_log_probs: Any, advantages: Any) -> tuple[Any, Any, dict[str, float]]:
        """Score ``pb`` under the teacher and return ``(old_log_probs, advantages, metrics)`` for
        the update: the student's log-probs (computed now when the update would have used its
        own forward), the advantages with the signal, and ``distill/reverse_kl`` (the mean
        per-token estimate over generated tokens, before any baseline), ``distill/signal_std``
        (its spread), ``distill/teacher_log_prob`` and ``distill/student_log_prob``."""
        if old_log_probs is None:
            old_log_probs = actor.compute_log_probs(pb)
        teacher = actor.compute_log_probs(pb, self.teacher)
        mask = pb.response_mask.to(old_log_probs.device)
        loss = self.loss
        kl = token_kl(old_log_probs, teacher, mask, loss.loss_mode, log_prob_min_clamp=loss.log_prob_min_clamp,
                      loss_max_clamp=loss.loss_max_clamp)
        out = distill_advantages(kl_baseline(kl, mask, loss.baseline), float(loss.distillation_loss_coef),
                                 advantages if loss.use_task_rewards else None)
        mean = masked_mean(kl, mask)
        metrics = {"distill/reverse_kl": float(mean),
                   "distill/signal_std": float(masked_mean((kl - mean).pow(2), mask).sqrt()),
                   "distill/teacher_log_prob": float(masked_mean(teacher.clamp(min=-1e4), mask)),
                   "distill/student_log_prob": float(masked_mean(old_log_probs, mask))}
        return old_log_probs, out.cpu(), metrics


def check_distillation(d: DistillationSection) -> None:
    """``distillation``: a teacher path when enabled, a registered loss mode, sane numbers (the
    vocab check needs the tokenizers: the trainer runs it when it loads the teacher).

    Raises:
        ConfigError: naming the key and what it must be.
    """
    loss = d.distillation_loss
    prefix = "distillation.distillation_loss."
    require([
        ("distillation.teacher_model.model_path", not d.enabled or bool(d.teacher_model.model_path),
         "set with distillation.enabled=true (a Hugging Face folder whose tokenizer is the student's)"),
        (prefix + "loss_mode", loss.loss_mode in DISTILLATION_LOSSES,
         f"one of {tuple(DISTILLATION_LOSSES.names())}, got {loss.loss_mode!r}"),
        (prefix + "use_policy_gradient", loss.use_policy_gradient is True,
         "true (agentloop feeds the teacher's per-token signal to the policy gradient as an advantage)"),
        (prefix + "distillation_loss_coef", math.isfinite(loss.distillation_loss_coef)
         and loss.distillation_loss_coef >= 0, f"a finite number >= 0, got {loss.distillation_loss_coef}"),
        (prefix + "loss_max_clamp", loss.loss_max_clamp is None or loss.loss_max_clamp > 0,
         f"null or > 0, got {loss.loss_max_clamp}"),
        (prefix + "log_prob_min_clamp", loss.log_prob_min_clamp is None or loss.log_prob_min_clamp < 0,
         f"null or < 0 (a log-prob floor), got {loss.log_prob_min_clamp}"),
        (prefix + "baseline", loss.baseline in DISTILLATION_BASELINES,
         f"one of {DISTILLATION_BASELINES}, got {loss.baseline!r}"),
    ])

