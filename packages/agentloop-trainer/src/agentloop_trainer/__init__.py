"""Policy-gradient training (GRPO and its variants) for agentloop rollouts, in rooms by concern:

- :mod:`~agentloop_trainer.config`: the config (sections, loading with verl's spellings, checks).
- :mod:`~agentloop_trainer.data`: datasets in verl's layout, the run's rows and batches.
- :mod:`~agentloop_trainer.task`: the built-in calculator task and its demonstrations.
- :mod:`~agentloop_trainer.policy`: the tokenizer and chat template, the tiny model, its warm-up.
- :mod:`~agentloop_trainer.rollout`: the engines and the agent loops rolling out rows.
- :mod:`~agentloop_trainer.reward`: scorers and how they combine with the loop's reward.
- :mod:`~agentloop_trainer.update`: advantages, losses, the actor, FSDP2, weights.
- :mod:`~agentloop_trainer.stages`: SFT, GRPO and asynchronous GRPO as peer drivers.
- :mod:`~agentloop_trainer.checkpoint`: checkpoint formats, save and resume.
- :mod:`~agentloop_trainer.eval`: held-out sets, pass@k / avg@n / maj@n with standard errors.
- :mod:`~agentloop_trainer.view`: metrics, the reward curve, the trajectory page.
- :mod:`~agentloop_trainer.cli`: the ``agentloop`` command; :mod:`~agentloop_trainer.pretrained`:
  ``agentloop model fetch|convert``.

``import agentloop_trainer`` stays light: torch, transformers and the engines are imported by
the modules that use them.
"""

from importlib.metadata import version as _distribution_version

from agentloop_trainer.config import ConfigError, TrainConfig, load_config
from agentloop_trainer.reward import answer_reward, extract_answer
from agentloop_trainer.update import (
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
