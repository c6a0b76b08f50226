"""The value model's settings (verl: ``critic``) and their checks, read only with
``algorithm.adv_estimator=gae``.

Keys keep verl's spelling (``critic.optim.lr``, ``critic.ppo_epochs``, ``critic.cliprange_value``,
``critic.model.path``...), so a verl PPO config's critic section means the same here. The
value model itself is :mod:`agentloop_trainer.update.critic`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["CriticModelSection", "CriticOptimSection", "CriticSection", "critic_checks"]


@dataclass
class CriticOptimSection:
    """The critic's own AdamW (verl: ``critic.optim``)."""

    lr: float | None = None
    """Learning rate of the value model. Required with ``adv_estimator=gae`` (verl's default is
    1e-5 for 7B models; a value model that starts from a policy checkpoint usually wants a
    larger one than the policy's)."""
    weight_decay: float = 0.01
    """AdamW weight decay (verl's default)."""


@dataclass
class CriticModelSection:
    """Where the value model starts (verl: ``critic.model``)."""

    path: str | None = None
    """A Hugging Face folder the critic's trunk loads from; null: the policy's starting
    checkpoint (``model.path``, after the SFT warm-up when there is one), as verl's examples set
    it. A scalar value head is added on top."""


@dataclass
class CriticSection:
    """The value model for PPO with GAE (verl: ``critic``)."""

    optim: CriticOptimSection = field(default_factory=CriticOptimSection)
    """The critic's optimizer (``critic.optim.lr``, ``critic.optim.weight_decay``)."""
    model: CriticModelSection = field(default_factory=CriticModelSection)
    """The critic's starting checkpoint (``critic.model.path``)."""
    ppo_epochs: int | None = None
    """Passes of the critic over each batch; null: ``actor_rollout_ref.actor.ppo_epochs``."""
    ppo_mini_batch_size: int | None = None
    """Prompts per critic optimizer step (x ``rollout.n`` rows, as the actor's); null:
    ``actor_rollout_ref.actor.ppo_mini_batch_size``."""
    ppo_micro_batch_size_per_gpu: int | None = None
    """Rows per critic forward/backward pass (gradients accumulate over a mini-batch); null:
    the whole mini-batch in one pass."""
    cliprange_value: float = 0.5
    """Value clipping: the new value may move at most this far from the value the batch was
    scored with before the squared error counts it (PPO's clipped value loss; verl's default)."""
    grad_clip: float = 1.0
    """Max global gradient norm of the critic."""


def critic_checks(estimator: str, needs_critic: bool, critic: CriticSection, *, gamma: float, lam: float,
                  turn_credit: str, critic_warmup: int) -> list[tuple[str, bool, str]]:
    """``(key, ok, what it must be)`` checks of the critic's keys; the critic's own keys are
    only asked for when the estimator (``algorithm.adv_estimator``) needs a critic."""
    checks = [("trainer.critic_warmup", critic_warmup >= 0, ">= 0 (steps that train only the critic)")]
    if not needs_critic:
        return checks
    why = f"with algorithm.adv_estimator={estimator} (it trains a value model)"
    return [*checks,
            ("critic.optim.lr", critic.optim.lr is not None and critic.optim.lr > 0,
             f"set to a learning rate > 0 {why}, e.g. critic.optim.lr=1e-4"),
            ("critic.cliprange_value", critic.cliprange_value > 0, f"> 0 {why}"),
            ("critic.grad_clip", critic.grad_clip > 0, f"> 0 {why}"),
            ("critic.ppo_epochs", critic.ppo_epochs is None or critic.ppo_epochs >= 1, "null or at least 1"),
            ("critic.ppo_mini_batch_size", critic.ppo_mini_batch_size is None or critic.ppo_mini_batch_size >= 1,
             "null or at least 1"),
            ("critic.ppo_micro_batch_size_per_gpu",
             critic.ppo_micro_batch_size_per_gpu is None or critic.ppo_micro_batch_size_per_gpu >= 1,
             "null or at least 1"),
            ("algorithm.gamma", 0.0 <= gamma <= 1.0, "between 0 and 1 (GAE's discount per model token)"),
            ("algorithm.lam", 0.0 <= lam <= 1.0, "between 0 and 1 (GAE's lambda)"),
            ("algorithm.turn_credit", turn_credit == "trajectory",
             f"trajectory {why} (GAE gives every model token its own advantage)")]
