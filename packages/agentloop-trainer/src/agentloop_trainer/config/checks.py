"""Range and choice checks that types cannot express, run on every loaded config: each room's
``check`` on its own sections, given the facts it needs from other sections, then the checks
of the ``trainer`` section and the cross-section ones (the critic's keys against the estimator
and ``trainer.critic_warmup``)."""

from __future__ import annotations

from agentloop_core.runtime.host_memory import MAX_MMAP_THRESHOLD
from agentloop_trainer.config.sections import TrainConfig
from agentloop_trainer.config_base import ConfigError, require
from agentloop_trainer.data.settings import check as check_data
from agentloop_trainer.loggers import check as check_loggers
from agentloop_trainer.policy.chat_templates import custom_chat_template
from agentloop_trainer.policy.settings import TRAIN_DTYPES
from agentloop_trainer.policy.settings import check as check_policy
from agentloop_trainer.reward.checks import check as check_reward
from agentloop_trainer.reward.settings import REWARD_SOURCES
from agentloop_trainer.rollout.settings import ROLLOUT_DTYPES, filter_groups_checks, uses_ray
from agentloop_trainer.rollout.settings import check as check_rollout
from agentloop_trainer.update.critic_settings import critic_checks
from agentloop_trainer.update.distill import check_distillation
from agentloop_trainer.update.settings import check as check_update
from agentloop_trainer.update.settings import needs_critic

__all__ = ["REWARD_SOURCES", "ROLLOUT_DTYPES", "TRAINER_MODES", "TRAIN_DTYPES", "validate"]

TRAINER_MODES = ("sync", "one_step_off", "async")
"""Values of ``trainer.mode``."""


def validate(cfg: TrainConfig) -> None:
    """Range and choice checks that types cannot express.

    Raises:
        ConfigError: naming the key.
    """
    arr, alg, tc = cfg.actor_rollout_ref, cfg.algorithm, cfg.trainer
    r = arr.rollout
    check_update(arr.actor, alg, rollout_n=r.n, train_batch_size=cfg.data.train_batch_size)
    require([
        *critic_checks(alg.adv_estimator, needs_critic(alg), cfg.critic, gamma=alg.gamma,
                       lam=alg.lam, turn_credit=alg.turn_credit, critic_warmup=tc.critic_warmup),
        ("trainer.total_steps", tc.total_steps >= 0, ">= 0"),
        ("trainer.log_trajectories_per_step", tc.log_trajectories_per_step >= 0, ">= 0"),
        ("trainer.fsdp_ranks", tc.fsdp_ranks >= 1, "at least 1"),
        ("trainer.device", tc.device in ("cpu", "cuda"), "cpu or cuda"),
        ("trainer.host_mmap_threshold_mb",
         tc.host_mmap_threshold_mb is None or 1 <= tc.host_mmap_threshold_mb <= MAX_MMAP_THRESHOLD >> 20,
         f"1 to {MAX_MMAP_THRESHOLD >> 20} (glibc's range), or null for glibc's adaptive threshold"),
        ("trainer.launcher", tc.launcher in ("spawn", "ray"), "spawn or ray"),
        ("trainer.resume", tc.resume in ("never", "auto", "must"), "never, auto or must"),
        ("trainer.hf_max_shard_megabytes", tc.hf_max_shard_megabytes >= 1, "at least 1"),
    ])
    check_data(cfg.data)
    check_policy(cfg.model, cfg.sft)
    _validate_mode(cfg)
    check_rollout(r, cfg.ray, mode=tc.mode)
    check_loggers(tc)
    require(filter_groups_checks(alg.filter_groups, n=r.n, mode=tc.mode))
    check_reward(cfg.reward, cfg.reward_model, rollout_n=r.n, on_ray=uses_ray(r, cfg.ray),
                 response_length=cfg.data.max_response_length)
    check_distillation(cfg.distillation)
    custom_chat_template(cfg.model)  # an unknown name or a missing file fails here, before anything loads


def _validate_mode(cfg: TrainConfig) -> None:
    """``trainer.mode`` and ``trainer.max_staleness`` (what the asynchronous modes need of the
    engine is the rollout's check)."""
    tc = cfg.trainer
    if tc.mode not in TRAINER_MODES:
        raise ConfigError(f"config trainer.mode must be one of {TRAINER_MODES}, got {tc.mode!r}")
    fixed = {"sync": 0, "one_step_off": 1}
    if tc.mode in fixed and tc.max_staleness not in (None, fixed[tc.mode]):
        raise ConfigError(f"config trainer.max_staleness is {fixed[tc.mode]} in trainer.mode={tc.mode}, got "
                          f"{tc.max_staleness}; leave it unset or use trainer.mode=async for another bound")
    if tc.max_staleness is not None and tc.max_staleness < 0:
        raise ConfigError(f"config trainer.max_staleness must be >= 0 (policy versions), got {tc.max_staleness}")


