"""The training config, the one record ``agentloop train`` reads: OmegaConf structured defaults
with verl-familiar names, composed of the sections the trainer's rooms declare.

Each room owns its sections and their checks (``data/settings.py``, ``policy/settings.py``,
``reward/settings.py``, ``rollout/settings.py``, ``update/settings.py``, ``loggers/settings.py``);
this package only composes them, loads a config and reads verl's spellings. The room order is
in ``docs/architecture.md`` and held by ``tests/test_rooms.py``.

- :mod:`~agentloop_trainer.config.sections`: :class:`TrainConfig` (the root), composed of the
  rooms' sections, and the ``trainer`` section.
- :mod:`~agentloop_trainer.config.actor_rollout_ref`: the ``actor_rollout_ref`` section (the
  update room's actor and reference, the rollout room's rollout).
- :mod:`~agentloop_trainer.config.loading`: defaults, a YAML file and ``key=value`` overrides
  merged, every key checked (:func:`load_config`).
- :mod:`~agentloop_trainer.config.verl_compat`: verl's spellings, read as agentloop's.
- :mod:`~agentloop_trainer.config.checks`: every room's checks, composed (:func:`validate`).
- :mod:`~agentloop_trainer.config.accessors`: derived settings read in one place.
- :mod:`~agentloop_trainer.config.nodes`: the loaded config as the OmegaConf node it is (merge,
  read-write, plain dicts of sections), typed.

A record mirroring a YAML section is named ``*Section``; the record a component is built with
is named ``*Config`` (:class:`~agentloop_trainer.update.actor.ActorConfig`).
"""

from agentloop_trainer.config.accessors import (
    custom_chat_template,
    engine_plugin,
    max_staleness,
    offload_enabled,
    reference_offloaded,
    uses_ray,
)
from agentloop_trainer.config.actor_rollout_ref import (
    ActorFSDPSection,
    ActorRolloutRefSection,
    ActorSection,
    AgentSection,
    MultiTurnSection,
    RefFSDPSection,
    RefSection,
    RolloutSection,
    ValKwargsSection,
)
from agentloop_trainer.config.checks import (
    REWARD_SOURCES,
    ROLLOUT_DTYPES,
    TRAIN_DTYPES,
    TRAINER_MODES,
    validate,
)
from agentloop_trainer.config.errors import ConfigError
from agentloop_trainer.config.loading import FREE_FORM, load_config, to_yaml
from agentloop_trainer.config.nodes import (
    as_train_config,
    config_from_yaml,
    config_node,
    merged_config,
    plain_dict,
)
from agentloop_trainer.config.sections import (
    AlgorithmSection,
    CustomRewardFunctionSection,
    DataSection,
    ModelSection,
    RaySection,
    RewardSection,
    SFTSection,
    TrainConfig,
    TrainerSection,
)
from agentloop_trainer.reward.settings import JudgeSection, OverlongBufferSection, RewardModelSection
from agentloop_trainer.rollout.settings import FilterGroupsSection

__all__ = [
    "ActorFSDPSection",
    "ActorRolloutRefSection",
    "ActorSection",
    "AgentSection",
    "AlgorithmSection",
    "ConfigError",
    "CustomRewardFunctionSection",
    "DataSection",
    "FREE_FORM",
    "FilterGroupsSection",
    "JudgeSection",
    "ModelSection",
    "MultiTurnSection",
    "OverlongBufferSection",
    "REWARD_SOURCES",
    "ROLLOUT_DTYPES",
    "RaySection",
    "RefFSDPSection",
    "RefSection",
    "RewardModelSection",
    "RewardSection",
    "RolloutSection",
    "SFTSection",
    "TRAINER_MODES",
    "TRAIN_DTYPES",
    "TrainConfig",
    "TrainerSection",
    "ValKwargsSection",
    "as_train_config",
    "config_from_yaml",
    "config_node",
    "custom_chat_template",
    "engine_plugin",
    "load_config",
    "max_staleness",
    "merged_config",
    "offload_enabled",
    "plain_dict",
    "reference_offloaded",
    "to_yaml",
    "uses_ray",
    "validate",
]
