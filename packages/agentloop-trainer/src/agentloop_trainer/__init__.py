"""GRPO training for agentloop rollouts: the calculator task, SFT warm-up, FSDP2, the CLI.

``import agentloop_trainer`` stays light: torch, transformers and the engines are imported by
the modules that use them.
"""

from agentloop_trainer.algos import (
    aggregate_loss,
    compute_advantages,
    group_advantages,
    kl_k3,
    masked_mean,
    ppo_clip_loss,
    sequence_weights,
    trajectory_advantages,
    truncated_importance_weight,
)
from agentloop_trainer.config import ConfigError, TrainConfig, load_config
from agentloop_trainer.reward import answer_reward, extract_answer

__version__ = "0.3.0"

__all__ = [
    "ConfigError",
    "TrainConfig",
    "aggregate_loss",
    "answer_reward",
    "compute_advantages",
    "extract_answer",
    "group_advantages",
    "kl_k3",
    "load_config",
    "masked_mean",
    "ppo_clip_loss",
    "sequence_weights",
    "trajectory_advantages",
    "truncated_importance_weight",
]
