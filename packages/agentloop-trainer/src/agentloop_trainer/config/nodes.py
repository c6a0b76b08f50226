"""The loaded config as what it is at run time, an OmegaConf ``DictConfig``, with typed helpers.

Code reads the config as a :class:`~agentloop_trainer.config.sections.TrainConfig` (OmegaConf's
structured configs are duck-typed as their dataclass, and the schema is what a reader needs).
OmegaConf's own functions take and return untyped nodes and broad unions; the helpers here are
the one place where the two meet, each checking what it converts.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, cast

from agentloop_trainer.config.errors import ConfigError
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


def plain_dict(node: Any, key: str, *, resolve: bool = True) -> dict[str, Any]:
    """An OmegaConf mapping (a section of the config) as a plain ``dict`` with ``str`` keys.

    ``OmegaConf.to_container`` is typed as any container or scalar; a section of the config is a
    mapping with string keys, and this says so once, with a check.

    Args:
        node: The section (a ``DictConfig``; a plain mapping is returned as a shallow copy).
        key: Its dotted config key, for the error (``actor_rollout_ref.actor``).
        resolve: Resolve ``${...}`` interpolations (``OmegaConf.to_container``'s ``resolve``).

    Raises:
        ConfigError: ``node`` is not a mapping with string keys (a ``ValueError``).
    """
    from omegaconf import DictConfig, OmegaConf

    value = OmegaConf.to_container(node, resolve=resolve) if isinstance(node, DictConfig) else node
    if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
        raise ConfigError(f"config {key} must be a mapping of names to values, got {type(value).__name__}: {value!r}")
    return dict(value)
