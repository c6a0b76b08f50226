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
from agentloop_trainer.policy.precision import resolve_dtype

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


def _load_yaml(config_file: str | Path) -> Any:
    """The file as an OmegaConf node; a file that is missing, not UTF-8 or not YAML is a one-line
    :class:`ConfigError` naming the file, line and column (not a parser traceback)."""
    import yaml
    from omegaconf import OmegaConf

    try:
        return OmegaConf.load(str(config_file))
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f"{config_file}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(config_file)
        what = " ".join(str(part) for part in (exc.context, exc.problem) if part)
        raise ConfigError(f"{where}: malformed YAML: {what}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{config_file}: malformed YAML: {' '.join(str(exc).split())}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{config_file}: not UTF-8 text (byte {exc.start}); save the config as UTF-8") from None
    except OSError as exc:
        raise ConfigError(f"--config {config_file}: {exc.strerror or exc}") from None


def _once(notice: Callable[[str], None]) -> Callable[[str], None]:
    seen: set[str] = set()

    def once(message: str) -> None:
        if message not in seen:
            seen.add(message)
            notice(message)
    return once


def load_config(overrides: Sequence[str] = (), config_file: str | Path | None = None,
                notice: Callable[[str], None] = _notice) -> TrainConfig:
    """Build the config from defaults, an optional YAML file, then ``key=value`` overrides.

    verl's spellings are accepted in both (``actor_rollout_ref.model.path``,
    ``trainer.total_training_steps``...; see :mod:`agentloop_trainer.config.verl_compat`), each with
    a one-line notice.

    Args:
        overrides: Dotted ``key=value`` strings, e.g. ``actor_rollout_ref.rollout.n=4``.
        config_file: YAML file merged over the defaults.
        notice: Receives one line per verl key that was translated or ignored, and one about
            ``model.dtype`` where bfloat16 is not native to ``trainer.device``
            (:func:`~agentloop_trainer.policy.precision.resolve_dtype`).

    Returns:
        A read-only OmegaConf ``DictConfig`` typed by :class:`TrainConfig`.

    Raises:
        ConfigError: an unknown key (naming the closest valid one), a malformed override, a
            value of the wrong type, or a config file that is missing or not YAML (naming its
            line and column).
    """
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from agentloop_trainer.config.verl_compat import translate

    notice = _once(notice)  # a key set in the file and again on the command line: one notice
    cfg = OmegaConf.structured(TrainConfig)
    valid = _leaf_keys(cfg)
    bools = _bool_keys(cfg)
    layers: list[dict[str, Any]] = []
    try:
        if config_file is not None:
            layers.extend(_file_layers(Path(config_file), notice))
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
    _check_tool_config(train_config, notice)
    train_config.model.dtype = resolve_dtype(train_config.model.dtype, train_config.trainer.device, notice)
    OmegaConf.set_readonly(config_node(train_config), True)
    return train_config


def _file_layers(path: Path, notice: Callable[[str], None], seen: tuple[Path, ...] = ()) -> list[dict[str, Any]]:
    """A YAML config file as flat layers, lowest first: the configs its Hydra ``defaults:`` list
    names (verl's base config read as agentloop's defaults, another file of the same folder
    read as it is), and the file itself where ``_self_`` stands (last when it is not listed)."""
    from omegaconf import OmegaConf

    from agentloop_trainer.config.verl_compat import HYDRA_SECTIONS, VERL_BASE_CONFIGS

    if path.resolve() in seen:
        raise ConfigError(f"{path}: its defaults list includes itself ({' -> '.join(p.name for p in seen)})")
    loaded = OmegaConf.to_container(_load_yaml(path), resolve=True)
    if not isinstance(loaded, dict):
        raise ConfigError(f"{path} is not a YAML mapping of config sections")
    for section, why in HYDRA_SECTIONS.items():
        if loaded.pop(section, None) is not None:
            notice(f"{path.name}: section {section} ignored ({why})")
    defaults = loaded.pop("defaults", None)
    if defaults is None:
        return [_flatten(loaded)]
    if not isinstance(defaults, list):
        raise ConfigError(f"{path}: defaults must be a list of config names (e.g. [ppo_trainer, _self_])")
    layers: list[dict[str, Any]] = []
    own = _flatten(loaded)
    for entry in defaults:
        sibling = path.parent / f"{entry}.yaml" if isinstance(entry, str) else None
        if entry == "_self_":
            layers.append(own)
        elif isinstance(entry, str) and entry in VERL_BASE_CONFIGS:
            why = VERL_BASE_CONFIGS[entry]
            if why is not None:
                raise ConfigError(f"{path}: defaults entry {entry!r} is not supported: {why}")
            notice(f"{path.name}: defaults entry {entry} (verl's base config) read as agentloop's defaults")
        elif sibling is not None and sibling.is_file():
            layers.extend(_file_layers(sibling, notice, (*seen, path.resolve())))
        else:
            bases = ", ".join(k for k, v in VERL_BASE_CONFIGS.items() if v is None)
            raise ConfigError(f"{path}: defaults entry {entry!r} is neither verl's base config ({bases}) nor a "
                              f"file {path.parent}/<name>.yaml; merge its keys into this file")
    if "_self_" not in defaults:
        layers.append(own)
    return layers


def config_file_of(config: str | None, config_path: str | None, config_name: str | None,
                   notice: Callable[[str], None] = _notice) -> str | None:
    """The config file of ``--config``, or of Hydra's ``--config-path``/``--config-name`` as
    verl's run scripts pass them (``<config_path>/<config_name>.yaml``).

    verl's entry point defaults ``--config-name`` to its base config, ``ppo_trainer``; naming
    that (or giving only ``--config-path``) reads agentloop's defaults, with a notice.

    Raises:
        ConfigError: ``--config`` together with the Hydra options, a base config agentloop does
            not read, or a file that does not exist.
    """
    from agentloop_trainer.config.verl_compat import VERL_BASE_CONFIGS

    if config_path is None and config_name is None:
        return config
    if config is not None:
        raise ConfigError("give either --config FILE or --config-path/--config-name, not both")
    name = (config_name or "ppo_trainer").removesuffix(".yaml")
    if name in VERL_BASE_CONFIGS:
        why = VERL_BASE_CONFIGS[name]
        if why is not None:
            raise ConfigError(f"--config-name {name} is not supported: {why}")
        notice(f"--config-name {name} (verl's base config) read as agentloop's defaults")
        return None
    file = Path(config_path or ".") / f"{name}.yaml"
    if not file.is_file():
        raise ConfigError(f"--config-path/--config-name: {str(file)!r} does not exist")
    return str(file)


def _check_tool_config(cfg: TrainConfig, notice: Callable[[str], None]) -> None:
    """Read the tool config's entries (verl's tool classes read as agentloop's, with their
    notices) before the run starts; nothing is imported or contacted. A file that does not exist
    yet is left to the run."""
    path = cfg.actor_rollout_ref.rollout.multi_turn.tool_config_path
    if not path or not Path(path).expanduser().is_file():
        return
    from agentloop_tools.load_tools import tool_config_entries

    try:
        tool_config_entries(path, notice=notice)
    except ValueError as exc:
        raise ConfigError(f"config actor_rollout_ref.rollout.multi_turn.tool_config_path: {exc}") from None


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
