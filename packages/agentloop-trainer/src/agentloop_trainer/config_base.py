"""What every room's settings module uses, below every room: the one error a config raises,
a section as a plain dict, and the check runner.

Each trainer room declares its config section and a ``check`` beside it (``update/settings.py``,
``reward/settings.py``...); :mod:`agentloop_trainer.config` composes them. This module imports no
room, so any room may import it (``tests/test_rooms.py`` holds it to that).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

__all__ = ["Check", "ConfigError", "plain_dict", "require"]

Check = tuple[str, bool, str]
"""``(key, ok, what it must be)``: one range or choice check of a section's key."""


class ConfigError(ValueError):
    """A config key or value is wrong; the message names it and the fix."""


def require(checks: Iterable[Check]) -> None:
    """Raise on the first failed check.

    Raises:
        ConfigError: ``config <key> must be <what it must be>``.
    """
    for key, ok, expected in checks:
        if not ok:
            raise ConfigError(f"config {key} must be {expected}")


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
