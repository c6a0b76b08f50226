"""The PPO pieces of a policy-gradient step (``algorithm.adv_estimator=gae``): building the
critic from the config, and the step's advantages and critic update
(:class:`~agentloop_trainer.update.critic.Critic`), so the GRPO loop only asks whether it has
a critic."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from agentloop_trainer.config.sections import TrainConfig

__all__ = ["build_critic", "uses_critic"]


def uses_critic(cfg: TrainConfig) -> bool:
    """Whether ``algorithm.adv_estimator`` reads a value model (``gae``)."""
    from agentloop_trainer.update.advantages import ADVANTAGE_ESTIMATORS

    estimator = ADVANTAGE_ESTIMATORS.find(cfg.algorithm.adv_estimator)
    return estimator is not None and estimator.needs_critic


def build_critic(cfg: TrainConfig, model_path: str | Path | None) -> Any:
    """The run's :class:`~agentloop_trainer.update.critic.Critic`: ``critic.model.path`` (or the
    policy's starting checkpoint ``model_path``) loaded in float32, with its own LoRA adapter
    when ``model.lora_rank > 0``, under a fresh value head; sharded like the policy when the
    process group has several ranks (``trainer.fsdp_ranks > 1``: every rank calls this).

    Raises:
        ValueError: neither ``critic.model.path`` nor a starting checkpoint is known.
    """
    import torch
    import torch.distributed as dist

    from agentloop_engines.adapters.hf.vision import load_model
    from agentloop_trainer.policy.model import apply_lora, use_cpu_matmul
    from agentloop_trainer.update.critic import Critic, ValueModel, shard_critic

    path = cfg.critic.model.path or model_path
    if path is None:
        raise ValueError("algorithm.adv_estimator=gae needs a checkpoint for the critic: set critic.model.path or "
                         "model.path")
    m = cfg.model
    backbone = load_model(str(path), torch.float32)
    if m.lora_rank > 0:
        backbone = apply_lora(backbone, m.lora_rank, m.lora_alpha, m.target_modules)
    use_cpu_matmul(backbone, m.cpu_matmul, cfg.trainer.device)
    model = ValueModel(backbone)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        model = shard_critic(model, cfg.trainer.device, m.dtype)
    a = cfg.actor_rollout_ref.actor
    return Critic(model, cfg.critic, gamma=cfg.algorithm.gamma, lam=cfg.algorithm.lam,
                  actor_ppo_epochs=a.ppo_epochs, actor_mini_batch_size=a.ppo_mini_batch_size,
                  rollout_n=cfg.actor_rollout_ref.rollout.n, device=cfg.trainer.device, compute_dtype=m.dtype)
