"""Loading the config: defaults, a YAML file, then ``key=value`` overrides, with verl's spellings
translated (:mod:`~agentloop_trainer.config.verl_compat`) and every key checked."""

from __future__ import annotations

import difflib
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from agentloop_trainer.config.checks import validate
from agentloop_trainer.config.errors import ConfigError
from agentloop_trainer.config.nodes import as_train_config, config_node
from agentloop_trainer.config.sections import TrainConfig

FREE_FORM: tuple[str, ...] = (
    "actor_rollout_ref.rollout.engine_kwargs.", "actor_rollout_ref.rollout.agent.loops.",
    "custom_reward_function.reward_kwargs.", "reward.answer_format.",
)
"""Sections whose keys are the user's (engine arguments, per-loop settings, reward kwargs, data sources);
they are checked where they are used, against the engine or loop they configure."""


def _leaf_keys(node: Any, prefix: str = "") -> list[str]:
    from omegaconf import DictConfig

    keys = []
    for k in node:
        path = f"{prefix}{k}"
        child = node._get_node(k)
        if isinstance(child, DictConfig):
            keys.append(path)
            keys.extend(_leaf_keys(child, path + "."))
        else:
            keys.append(path)
    return keys


def _bool_keys(node: Any, prefix: str = "") -> dict[str, bool]:
    """Dotted keys whose schema type is ``bool``, each with whether it may be null."""
    from omegaconf import BooleanNode, DictConfig

    keys: dict[str, bool] = {}
    for k in node:
        child = node._get_node(k)
        if isinstance(child, DictConfig):
            keys.update(_bool_keys(child, f"{prefix}{k}."))
        elif isinstance(child, BooleanNode):
            keys[f"{prefix}{k}"] = child._is_optional()
    return keys


def _check_bool(key: str, value: Any, optional: bool) -> None:
    """OmegaConf turns any int (``2``, ``0``) into a bool; a bool key here takes ``true`` or
    ``false`` (YAML's ``yes``/``no`` too), so a number meant for another key is an error."""
    if value is None and optional:
        return
    if not isinstance(value, bool):
        raise ConfigError(f"config {key} must be true or false, got {value!r} ({type(value).__name__})")


def _flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    """Dotted leaf keys of a nested mapping (lists stay whole), so that two layers, or two
    overrides, setting different keys of one section both survive."""
    if isinstance(value, dict) and value:
        out: dict[str, Any] = {}
        for k, v in value.items():
            out.update(_flatten(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: value}


def _check_key(key: str, valid: list[str]) -> None:
    if key in valid or (key + ".").startswith(FREE_FORM):
        return
    close = difflib.get_close_matches(key, valid, n=1, cutoff=0.5)
    if not close:
        # Match on the last component too: "rollout.temprature" -> "...rollout.temperature".
        tail = key.rsplit(".", 1)[-1]
        tails = {v.rsplit(".", 1)[-1]: v for v in valid}
        near = difflib.get_close_matches(tail, list(tails), n=1)
        close = [tails[near[0]]] if near else []
    hint = f"; did you mean {close[0]!r}?" if close else ""
    raise ConfigError(f"unknown config key {key!r}{hint} (see `agentloop train --show-config` for all keys)")


def _notice(message: str) -> None:
    print(f"agentloop: {message}", file=sys.stderr)


def load_config(overrides: Sequence[str] = (), config_file: str | Path | None = None,
                notice: Callable[[str], None] = _notice) -> TrainConfig:
    """Build the config from defaults, an optional YAML file, then ``key=value`` overrides.

    verl's spellings are accepted in both (``actor_rollout_ref.model.path``,
    ``trainer.total_training_steps``...; see :mod:`agentloop_trainer.config.verl_compat`), each with
    a one-line notice.

    Args:
        overrides: Dotted ``key=value`` strings, e.g. ``actor_rollout_ref.rollout.n=4``.
        config_file: YAML file merged over the defaults.
        notice: Receives one line per verl key that was translated or ignored.

    Returns:
        A read-only OmegaConf ``DictConfig`` typed by :class:`TrainConfig`.

    Raises:
        ConfigError: an unknown key (naming the closest valid one), a malformed override, or a
            value of the wrong type.
    """
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from agentloop_trainer.config.verl_compat import translate

    cfg = OmegaConf.structured(TrainConfig)
    valid = _leaf_keys(cfg)
    bools = _bool_keys(cfg)
    layers: list[dict[str, Any]] = []
    try:
        if config_file is not None:
            loaded = OmegaConf.to_container(OmegaConf.load(str(config_file)), resolve=True)
            if not isinstance(loaded, dict):
                raise ConfigError(f"{config_file} is not a YAML mapping of config sections")
            layers.append(_flatten(loaded))
        dotted: dict[str, Any] = {}
        for item in overrides:
            if "=" not in item:
                raise ConfigError(f"override {item!r} is not key=value (e.g. trainer.total_steps=20)")
            dotted.update(_flatten(OmegaConf.to_container(OmegaConf.from_dotlist([item.lstrip("+")]), resolve=True)))
        if dotted:
            layers.append(dotted)
    except OmegaConfBaseException as exc:
        raise ConfigError(f"bad config value: {exc}".strip()) from None
    merged = []
    for flat in layers:
        try:
            flat = translate(flat, set(valid), notice)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        for key, value in flat.items():
            _check_key(key, valid)
            if key in bools:
                _check_bool(key, value, bools[key])
        if isinstance(flat.get("trainer.logger"), str):  # verl's list, or one name / a comma string
            from agentloop_trainer.loggers import parse_logger_names

            flat["trainer.logger"] = parse_logger_names(flat["trainer.logger"])
        if isinstance(flat.get("trainer.resume"), bool):
            flat["trainer.resume"] = "must" if flat["trainer.resume"] else "never"
        merged.append(_nest(flat))
    try:
        train_config = as_train_config(OmegaConf.merge(cfg, *merged))
    except OmegaConfBaseException as exc:
        raise ConfigError(f"bad config value: {exc}".strip()) from None
    validate(train_config)
    OmegaConf.set_readonly(config_node(train_config), True)
    return train_config


def _nest(flat: dict[str, Any]) -> Any:
    from omegaconf import OmegaConf

    root: dict[str, Any] = {}
    for key, value in flat.items():
        node = root
        *parents, leaf = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return OmegaConf.create(root)


def to_yaml(cfg: TrainConfig) -> str:
    """The config as YAML (for ``--show-config`` and the run folder)."""
    from omegaconf import OmegaConf

    return OmegaConf.to_yaml(cfg)
