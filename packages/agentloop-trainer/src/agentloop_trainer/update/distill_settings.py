"""On-policy distillation's config section, under verl's keys (``distillation.*``), and its
check. What it does: :mod:`agentloop_trainer.update.distill`."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TeacherModelSection:
    """The teacher (verl: ``distillation.teacher_model``; verl's multi-teacher
    ``distillation.teacher_models.teacher_model.model_path`` is read as this one)."""

    model_path: str | None = None
    """Hugging Face checkpoint folder of the teacher. Its tokenizer must have the student's vocab
    (the same token ids): the teacher scores the student's own tokens. Loaded in the trainer,
    frozen and without gradients, like the KL reference."""


@dataclass
class DistillationLossSection:
    """How the teacher's scores become a training signal (verl: ``distillation.distillation_loss``)."""

    loss_mode: str = "k1"
    """A name in ``update.distill.DISTILLATION_LOSSES``: k1 (reverse KL estimated on the sampled
    token, ``log p_student(x_t) - log p_teacher(x_t)``) | k3 (``exp(-k1) - 1 + k1``: the
    low-variance estimator, >= 0)."""
    use_task_rewards: bool = False
    """false: pure distillation, each generated token's advantage is ``-coef * kl_t`` (no reward
    function needed; rewards are still scored and logged) | true: the task's advantage
    (``algorithm.adv_estimator`` / ``turn_credit``) plus ``-coef * kl_t`` on each token."""
    distillation_loss_coef: float = 1.0
    """``coef`` above (>= 0)."""
    use_policy_gradient: bool = True
    """verl's key; only true here: the per-token signal is an advantage of the PPO-clip policy
    gradient (verl's false backpropagates through the KL instead)."""
    loss_max_clamp: float | None = 10.0
    """Cap on the per-token signal's size (``|kl_t| <= cap``): a token the teacher finds nearly
    impossible cannot swamp the batch. null: none."""
    log_prob_min_clamp: float | None = -10.0
    """Floor on both log-probs before the difference. null: none."""
    baseline: str = "none"
    """What each token's signal is taken relative to (agentloop's key; verl subtracts nothing):
    none (verl's signal as it is) | mean (less the batch's mean ``kl_t`` over its generated
    tokens: most advantages are no longer negative) | whiten (that, then divided by their
    standard deviation). Measured in docs/distillation.md: on the tiny model it changed little."""


@dataclass
class DistillationSection:
    """On-policy distillation (verl: ``distillation``): a teacher scores every token the student
    samples; see docs/distillation.md."""

    enabled: bool = False
    """Score the student's rollouts with ``teacher_model`` each step."""
    teacher_model: TeacherModelSection = field(default_factory=TeacherModelSection)
    """The teacher."""
    distillation_loss: DistillationLossSection = field(default_factory=DistillationLossSection)
    """The signal."""
