"""The loaded config as what it is at run time, an OmegaConf ``DictConfig``, with typed helpers.

Code reads the config as a :class:`~agentloop_trainer.config.sections.TrainConfig` (OmegaConf's
structured configs are duck-typed as their dataclass, and the schema is what a reader needs).
OmegaConf's own functions take and return untyped nodes and broad unions; the helpers here are
the one place where the two meet, each checking what it converts.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, cast

from agentloop_trainer.config_base import plain_dict

__all__ = ["as_train_config", "config_from_yaml", "config_node", "merged_config", "plain_dict"]
from agentloop_trainer.config.sections import TrainConfig

if TYPE_CHECKING:
    from omegaconf import DictConfig


def config_node(cfg: TrainConfig) -> DictConfig:
    """``cfg`` as the ``DictConfig`` it is, for OmegaConf's functions (``read_write``...).

    Raises:
        TypeError: ``cfg`` is not an OmegaConf node (a bare ``TrainConfig()`` dataclass).
    """
    from omegaconf import DictConfig

    if not isinstance(cfg, DictConfig):
        raise TypeError(f"expected the run's config as an OmegaConf DictConfig, got {type(cfg).__name__}; "
                        "build it with agentloop_trainer.config.load_config (or OmegaConf.structured(TrainConfig))")
    return cfg


def as_train_config(node: object) -> TrainConfig:
    """An OmegaConf mapping node holding the run's config, typed by its schema.

    Raises:
        TypeError: ``node`` is not a ``DictConfig`` (a list, a scalar, None).
    """
    from omegaconf import DictConfig

    if not isinstance(node, DictConfig):
        raise TypeError(f"the training config must be an OmegaConf mapping of sections, got {type(node).__name__}")
    # The node has TrainConfig's keys (it was loaded, merged or copied from a checked config).
    return cast(TrainConfig, node)


def merged_config(cfg: TrainConfig, values: Mapping[str, Any]) -> TrainConfig:
    """A copy of ``cfg`` with ``values`` (nested sections, e.g. ``{"sft": {"resume": "auto"}}``)
    merged over it by ``OmegaConf.merge``; ``cfg`` itself is unchanged."""
    from omegaconf import OmegaConf

    return as_train_config(OmegaConf.merge(cfg, dict(values)))


def config_from_yaml(text: str) -> TrainConfig:
    """The config :func:`~agentloop_trainer.config.loading.to_yaml` wrote (``OmegaConf.create``
    of the text: how a spawned rank receives the driver's config)."""
    from omegaconf import OmegaConf

    return as_train_config(OmegaConf.create(text))
