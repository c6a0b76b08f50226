"""Training stages, peer drivers over the same rooms: SFT (:mod:`~agentloop_trainer.stages.sft`),
synchronous GRPO (:mod:`~agentloop_trainer.stages.grpo`) and asynchronous GRPO
(:mod:`~agentloop_trainer.stages.async_driver` over the staleness-bounded buffer of
:mod:`~agentloop_trainer.stages.async_buffer`, ``trainer.mode=one_step_off|async``).

:mod:`~agentloop_trainer.stages.build` builds the GRPO trainer from a config, on one process or
on every FSDP rank.
"""

from agentloop_trainer.stages.async_buffer import Group, StalenessBuffer, staleness_metrics
from agentloop_trainer.stages.async_driver import AsyncDriver
from agentloop_trainer.stages.build import (
    build_trainer,
    load_policy_tokenizer,
    needs_engine_copy,
    run_fsdp_training,
    seed_everything,
)
from agentloop_trainer.stages.grpo import PolicyGradientTrainer, actor_config

__all__ = [
    "AsyncDriver",
    "PolicyGradientTrainer",
    "Group",
    "StalenessBuffer",
    "actor_config",
    "build_trainer",
    "load_policy_tokenizer",
    "needs_engine_copy",
    "run_fsdp_training",
    "seed_everything",
    "staleness_metrics",
]
