"""GRPO training for agentloop rollouts: the calculator task, SFT warm-up, FSDP2, the CLI.

``import agentloop_trainer`` stays light: torch, transformers and the engines are imported by
the modules that use them.
"""

from importlib.metadata import version as _distribution_version

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

__version__ = _distribution_version("agentloop-trainer")
"""The installed distribution's version: pyproject.toml is its one source."""

__all__ = [
    "__version__",
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
