"""Config of the tool loops: :class:`ToolLoopSettings`, the keys every loop that runs tools
reads (``tool_agent``, LangGraph's ``react_agent``), which each loop's config class extends;
:class:`ToolAgentConfig`; the readers every tool loop shares (:func:`read_loop_config`,
:func:`resolve_tools`, :func:`resolve_interactions`); and the check a trainer runs on a user's
per-loop config section (:func:`check_loop_config_keys`).

A loop's config is a frozen dataclass (its ``config_class``) read from the rollout config, whose
other keys are ignored because the worker passes its whole config to every loop. A trainer that
holds a section meant for one loop can still reject typos with :func:`check_loop_config_keys`:
the valid keys are the dataclass fields plus the class's ``EXTRA_KEYS``, the keys the loop reads
outside the dataclass (tool and interaction sources).

Each field says once what it accepts: its type (``X | None`` admits None, a ``Literal[...]``
lists the choices) and :func:`loop_setting` (``positive=True`` for counts and limits). The
checks run when the config is built, so a loop's config class holds no list of its own.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
import warnings
import weakref
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal, TypeVar, Union

from agentloop_core.deprecation import renamed_attributes
from agentloop_tools.base import BaseTool
from agentloop_tools.interaction import BaseInteraction, load_interaction_config, load_interactions
from agentloop_tools.truncation import TruncateSide

__all__ = [
    "ToolAgentConfig",
    "ToolLoopSettings",
    "TruncateSide",
    "check_loop_config_keys",
    "loop_config_choices",
    "loop_config_keys",
    "loop_setting",
    "read_loop_config",
    "resolve_interactions",
    "resolve_tools",
]

_Settings = TypeVar("_Settings", bound="ToolLoopSettings")


def loop_setting(default: Any = dataclasses.MISSING, *, default_factory: Any = dataclasses.MISSING,
                 positive: bool = False) -> Any:
    """A field of a loop's config class.

    Args:
        default: The value when the config does not set the key (or sets it to None and the
            field's type does not admit None).
        default_factory: Makes the default instead (for dicts).
        positive: The value is a count or a limit: an ``int`` field must be an integer >= 1, a
            ``float`` field a number > 0 (None passes when the type admits it).
    """
    return dataclasses.field(default=default, default_factory=default_factory, metadata={"positive": positive})


@dataclass(frozen=True)
class _FieldRule:
    """What one config field accepts, read from its type and :func:`loop_setting`."""

    name: str
    nullable: bool
    """The type admits None: a None in the config is kept, not replaced by the default."""
    positive: bool
    number: bool
    """The type admits float: ``positive`` means > 0, not an integer >= 1."""
    mapping: bool
    """The type is a dict: the value must be a mapping."""
    choices: tuple[Any, ...] | None
    """The values of the field's ``Literal[...]`` type, or None."""


# Per config class, held weakly like every cache of the tool loops (a class defined in a test or a
# notebook cell can go away); classes are always weakly referenceable.
_RULES: weakref.WeakKeyDictionary[type, tuple[_FieldRule, ...]] = weakref.WeakKeyDictionary()


def _field_rule(f: dataclasses.Field[Any], hint: Any) -> _FieldRule:
    union = typing.get_origin(hint) in (Union, types.UnionType)
    kinds = [a for a in (typing.get_args(hint) if union else (hint,)) if a is not type(None)]
    literal = len(kinds) == 1 and typing.get_origin(kinds[0]) is Literal
    return _FieldRule(
        name=f.name, nullable=union and len(kinds) < len(typing.get_args(hint)),
        positive=bool(f.metadata.get("positive")), number=float in kinds,
        mapping=len(kinds) == 1 and typing.get_origin(kinds[0]) is dict,
        choices=typing.get_args(kinds[0]) if literal else None,
    )


def _rules(config_class: type) -> tuple[_FieldRule, ...]:
    rules = _RULES.get(config_class)
    if rules is None:
        hints = typing.get_type_hints(config_class)
        rules = tuple(_field_rule(f, hints[f.name]) for f in dataclasses.fields(config_class))
        _RULES[config_class] = rules
    return rules


def loop_config_choices(config_class: type) -> dict[str, tuple[Any, ...]]:
    """The choice-valued keys of a loop's config class and their choices, read from the fields'
    ``Literal[...]`` types.

    Raises:
        TypeError: ``config_class`` is not a dataclass.
    """
    _require_dataclass(config_class)
    return {r.name: r.choices for r in _rules(config_class) if r.choices is not None}


def _check_fields(settings: Any, loop_name: str, rules: Iterable[_FieldRule]) -> None:
    for rule in rules:
        value = getattr(settings, rule.name)
        if value is None and rule.nullable:
            continue
        or_none = " or None" if rule.nullable else ""
        if rule.choices is not None and value not in rule.choices:
            raise ValueError(f"{loop_name} config {rule.name} must be one of {rule.choices}, got {value!r}")
        if rule.mapping and not isinstance(value, Mapping):
            raise ValueError(f"{loop_name} config {rule.name} must be a mapping, got {type(value).__name__}")
        if not rule.positive or value is None:
            continue
        if rule.number:
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"{loop_name} config {rule.name} must be a positive number{or_none}, got {value!r}")
        elif isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{loop_name} config {rule.name} must be a positive integer{or_none}, got {value!r}")


@dataclass(frozen=True)
class ToolLoopSettings:
    """The keys every loop that runs tools reads; a loop's config class extends it with its own
    fields, sets ``LOOP_NAME`` and, if it reads more keys outside the dataclass, ``EXTRA_KEYS``.

    Values are checked when the settings are built (from a config or directly).

    Raises:
        ValueError: naming the loop, the key, the bad value and what is accepted.
    """

    LOOP_NAME: ClassVar[str] = "tool loop"
    """The loop's registered name, for error messages."""
    EXTRA_KEYS: ClassVar[tuple[str, ...]] = ("tools", "tool_config_path", "function_tool_path")
    """Keys the loop reads outside this dataclass: its tools (``resolve_tools``)."""

    response_length: int = loop_setting(1024, positive=True)
    """Token budget for everything after the prompt: generated, tool and user tokens."""
    prompt_length: int | None = loop_setting(None, positive=True)
    """Longest accepted rendered prompt, in tokens; None: no limit."""
    max_assistant_turns: int | None = loop_setting(None, positive=True)
    """Most model turns; None: bounded only by ``response_length`` (and the loop's own limits)."""
    tool_parser: str = "hermes"
    """Name of the tool-call parser (see ``agentloop_core.parsers.tool_parser_names()``)."""
    max_parallel_calls: int = loop_setting(4, positive=True)
    """Most tool calls run (concurrently) per turn; later calls of the turn get an error message."""
    max_tool_response_length: int = loop_setting(1024, positive=True)
    """Most characters of one tool response shown to the model."""
    tool_response_truncate_side: TruncateSide = "middle"
    """Which part of a long response to keep: ``left`` keeps the tail, ``right`` the head,
    ``middle`` head and tail."""
    tool_timeout_s: float | None = loop_setting(60.0, positive=True)
    """Time limit of one tool call unless the tool sets its own ``timeout_s``; None: no limit."""
    tool_reward: Literal["sum", "none"] = "sum"
    """``sum``: reward_score = step rewards of every call + each tool's ``calc_reward`` (+ the
    interaction's ``calculate_score`` where the loop has one); ``none``: reward_score is None
    (the trainer computes it)."""
    sanity_check: Literal["strict", "ignore_strippable", "disable"] = "strict"
    """Delta-tokenization check against full re-tokenization, see ``Trajectory.to_output``."""
    apply_chat_template_kwargs: dict[str, Any] = loop_setting(default_factory=dict)
    """Extra keyword arguments for the chat template (e.g. ``enable_thinking``)."""
    use_inference_chat_template: bool = False
    """Render history with the inference template even when it strips reasoning."""
    delta_strategy: Literal["auto", "history", "short"] = "auto"
    """How tool results and user turns are tokenized after a generated turn; see
    ``ChatRenderer(delta_strategy=)``. ``auto`` costs the same at turn 100 as at turn 1."""

    def __post_init__(self) -> None:
        _check_fields(self, self.LOOP_NAME, _rules(type(self)))

    @classmethod
    def from_mapping(cls: type[_Settings], config: Mapping[str, Any]) -> _Settings:
        """Read and check the loop's keys; other keys are ignored.

        Raises:
            ValueError: naming the key, the bad value and what is accepted.
        """
        return read_loop_config(cls, config)


@dataclass(frozen=True)
class ToolAgentConfig(ToolLoopSettings):
    """The ``tool_agent`` keys of the rollout config (other keys are ignored)."""

    LOOP_NAME: ClassVar[str] = "tool_agent"
    EXTRA_KEYS: ClassVar[tuple[str, ...]] = (
        *ToolLoopSettings.EXTRA_KEYS, "interaction", "interaction_config_path")
    """Keys the loop reads outside this dataclass: its tools (``resolve_tools``) and its
    interactions (``resolve_interactions``)."""

    max_user_turns: int | None = loop_setting(None, positive=True)
    """Most interaction replies; None: until the interaction ends the conversation."""


def read_loop_config(cls: type, config: Mapping[str, Any], *, loop_name: str | None = None,
                     nullable: tuple[str, ...] = (), positive: tuple[str, ...] = ()) -> Any:
    """Build a loop's frozen config dataclass from the rollout config and check it.

    Keys the dataclass does not name are ignored (the worker passes its whole config); a None
    value keeps the default unless the field's type admits None.

    Args:
        cls: The loop's config class: a :class:`ToolLoopSettings` subclass, or any dataclass
            (checked the same way, from its fields' types and :func:`loop_setting`).
        config: The rollout config.
        loop_name: For messages; default: ``cls.LOOP_NAME``.
        nullable: Deprecated: a field admits None when its type does.
        positive: Deprecated: declare it on the field, ``loop_setting(..., positive=True)``.

    Raises:
        ValueError: naming the loop, the key, the bad value and what is accepted.
        TypeError: ``cls`` is not a dataclass.
    """
    _require_dataclass(cls)
    rules = _rules(cls)
    if nullable or positive:
        warnings.warn("read_loop_config(nullable=, positive=) is deprecated and will be removed in the next "
                      "release; a field admits None when its type does (`int | None`), and "
                      "`loop_setting(default, positive=True)` marks a positive one",
                      DeprecationWarning, stacklevel=2)
        rules = tuple(dataclasses.replace(r, nullable=r.nullable or r.name in nullable,
                                          positive=r.positive or r.name in positive) for r in rules)
    data = {}
    for rule in rules:
        if rule.name in config and (config[rule.name] is not None or rule.nullable):
            data[rule.name] = config[rule.name]
    cfg = cls(**data)
    if not isinstance(cfg, ToolLoopSettings) or nullable or positive:  # settings check themselves
        _check_fields(cfg, loop_name or getattr(cls, "LOOP_NAME", cls.__name__), rules)
    return cfg


def _require_dataclass(config_class: Any) -> None:
    if not (isinstance(config_class, type) and dataclasses.is_dataclass(config_class)):
        raise TypeError(f"config_class must be a dataclass type, got {config_class!r}")


def loop_config_keys(config_class: type) -> frozenset[str]:
    """Every key a loop with this config class reads: the dataclass fields plus its
    ``EXTRA_KEYS`` (empty when the class declares none).

    Raises:
        TypeError: ``config_class`` is not a dataclass.
    """
    _require_dataclass(config_class)
    extra = getattr(config_class, "EXTRA_KEYS", ())
    return frozenset(f.name for f in dataclasses.fields(config_class)) | frozenset(extra)


def check_loop_config_keys(loop_name: str, config_class: type, keys: Iterable[str]) -> None:
    """Reject keys of a loop's config section that the loop would ignore, so a typo such as
    ``max_assistant_turn`` is an error instead of a silently unused setting.

    Args:
        loop_name: The loop's registered name, for the message (``"tool_agent"``).
        config_class: The loop's ``config_class`` (a dataclass, optionally with ``EXTRA_KEYS``).
        keys: The keys of the user's section for this loop.

    Raises:
        ValueError: naming each unknown key with the closest valid key, and every valid key.
        TypeError: ``config_class`` is not a dataclass.
    """
    valid = sorted(loop_config_keys(config_class))
    unknown = [str(k) for k in keys if k not in valid]
    if not unknown:
        return
    parts = []
    for key in unknown:
        close = difflib.get_close_matches(key, valid, n=1)
        parts.append(f"{key!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
    raise ValueError(f"{loop_name} config has unknown keys {', '.join(parts)}; valid keys: {', '.join(valid)}")


# Keyed by the configured paths (values, not object ids, so a key cannot be reused for something
# else) and kept for the process on purpose: the trainer and every loop share one set of tools.
# A process configures a handful of paths, so these stay small.
_TOOL_CACHE: dict[tuple[str | None, str | None], dict[str, BaseTool]] = {}


def resolve_tools(config: Mapping[str, Any]) -> dict[str, BaseTool]:
    """The loop's tools: ``config["tools"]`` (dict name -> BaseTool, or a list), else
    ``load_tools(tool_config_path, function_tool_path)``, loaded once per process and shared
    (per-trajectory state lives in tool instances, not in the tool objects).

    Raises:
        ValueError: a tool is not a BaseTool or its key differs from its name.
    """
    tools = config.get("tools")
    if tools is None:
        paths = (config.get("tool_config_path"), config.get("function_tool_path"))
        if paths == (None, None):
            return {}
        if paths not in _TOOL_CACHE:
            from agentloop_tools.load_tools import load_tools

            _TOOL_CACHE[paths] = load_tools(*paths)
        return _TOOL_CACHE[paths]
    items = tools.items() if isinstance(tools, Mapping) else ((getattr(t, "name", None), t) for t in tools)
    resolved: dict[str, BaseTool] = {}
    for name, tool in items:
        if not isinstance(tool, BaseTool):
            raise ValueError(f"loop config tools[{name!r}] is a {type(tool).__name__}, not a BaseTool; "
                             "wrap functions with @function_tool")
        if not isinstance(name, str) or name != tool.name:
            raise ValueError(f"loop config tools key {name!r} differs from the tool's name {tool.name!r}")
        resolved[name] = tool
    return resolved


_INTERACTION_CACHE: dict[str, dict[str, BaseInteraction]] = {}


def resolve_interactions(config: Mapping[str, Any]) -> dict[str, BaseInteraction]:
    """The loop's interactions by name: ``config["interaction"]`` (anything
    :func:`~agentloop_tools.interaction.load_interactions` takes), else the verl-style YAML at
    ``config["interaction_config_path"]``, loaded once per process and shared (per-trajectory
    state lives under each conversation's instance id).

    Raises:
        ValueError: both keys are set, or the spec or file is bad.
    """
    spec, path = config.get("interaction"), config.get("interaction_config_path")
    if spec is not None and path is not None:
        raise ValueError("loop config sets both 'interaction' and 'interaction_config_path'; keep one")
    if path is None:
        return load_interactions(spec)
    key = str(Path(path).expanduser().resolve())
    if key not in _INTERACTION_CACHE:
        _INTERACTION_CACHE[key] = load_interaction_config(key)
    return _INTERACTION_CACHE[key]


DEPRECATED_NAMES = {"LOOP_CONFIG_CHOICES": ("agentloop_tools.loop_config.loop_config_choices(ToolAgentConfig)",
                                            lambda: loop_config_choices(ToolAgentConfig))}
"""``LOOP_CONFIG_CHOICES``, the hand-kept dict of choices this module and ``agent_loop`` exported
before the choices were read from the fields' types; kept one release."""

__getattr__ = renamed_attributes(__name__, DEPRECATED_NAMES)
