"""Config of the tool loops: :class:`ToolLoopConfig`, the fields every loop that runs tools
reads (``tool_agent``, LangGraph's ``react_agent``), declared here once with their defaults and
extended by each loop's config class; :class:`ToolAgentConfig`; the readers every tool loop
shares (:func:`read_loop_config`, :func:`resolve_tools`, :func:`resolve_interactions`).

A loop's config is a frozen dataclass (its ``config_class``) that the rollout builds once per
loop name from :meth:`agentloop_core.settings.RolloutConfig.loop_mapping` (the trainer at
start-up), rejecting a section key the class does not name with core's
:func:`~agentloop_core.settings.check_loop_config_keys` (re-exported here). Mapping fields
(``apply_chat_template_kwargs``...) are kept as tuples of ``(key, value)`` pairs, so a config
holds no dict; ``dict(field)`` reads one.

Each field says once what it accepts: its type (``X | None`` admits None, a ``Literal[...]``
lists the choices) and :func:`loop_setting` (``positive=True`` for counts and limits). The
checks run when the config is built, so a loop's config class holds no list of its own.
"""

from __future__ import annotations

import dataclasses
import types
import typing
import weakref
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal, TypeVar, Union

from agentloop_core.parsers import DEFAULT_TOOL_PARSER
from agentloop_core.protocol import DEFAULT_RESPONSE_LENGTH
from agentloop_core.settings import check_loop_config_keys, loop_config_keys
from agentloop_core.vision import ImageLimits
from agentloop_tools.base import BaseTool
from agentloop_tools.interaction import BaseInteraction, load_interaction_config, load_interactions
from agentloop_tools.truncation import TruncateSide

__all__ = [
    "ToolAgentConfig",
    "ToolLoopConfig",
    "TruncateSide",
    "check_loop_config_keys",
    "loop_config_choices",
    "loop_config_keys",
    "loop_setting",
    "read_loop_config",
    "resolve_interactions",
    "resolve_tools",
]

_Config = TypeVar("_Config", bound="ToolLoopConfig")
_IMAGE_DEFAULTS = ImageLimits()


def loop_setting(default: Any = dataclasses.MISSING, *, positive: bool = False, mapping: bool = False) -> Any:
    """A field of a loop's config class.

    Args:
        default: The value when the config does not set the key (or sets it to None and the
            field's type does not admit None).
        positive: The value is a count or a limit: an ``int`` field must be an integer >= 1, a
            ``float`` field a number > 0 (None passes when the type admits it).
        mapping: The value is a mapping of names to values (type it
            ``tuple[tuple[str, Any], ...]``, default ``()``): given as a mapping, kept as pairs.
    """
    return dataclasses.field(default=default, metadata={"positive": positive, "mapping": mapping})


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
    """The type is a dict, or the field a ``loop_setting(mapping=True)``: the value must be a mapping."""
    pairs: bool
    """A ``loop_setting(mapping=True)``: a mapping is kept as ``(key, value)`` pairs."""
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
        mapping=(len(kinds) == 1 and typing.get_origin(kinds[0]) is dict) or bool(f.metadata.get("mapping")),
        pairs=bool(f.metadata.get("mapping")),
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
        if rule.mapping:
            if isinstance(value, Mapping) and rule.pairs:
                # Frozen as pairs: the config pickles to Ray workers and holds no dict.
                object.__setattr__(settings, rule.name, tuple(value.items()))
            elif not isinstance(value, Mapping) and not (
                    rule.pairs and isinstance(value, tuple) and all(isinstance(p, tuple) and len(p) == 2 for p in value)):
                raise ValueError(f"{loop_name} config {rule.name} must be a mapping, got {type(value).__name__}")
        if not rule.positive or value is None:
            continue
        if rule.number:
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"{loop_name} config {rule.name} must be a positive number{or_none}, got {value!r}")
        elif isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{loop_name} config {rule.name} must be a positive integer{or_none}, got {value!r}")


@dataclass(frozen=True)
class ToolLoopConfig:
    """The fields every loop that runs tools reads, each declared once with its default; a
    loop's config class extends it with its own fields and sets ``LOOP_NAME``.

    Values are checked when the config is built (from a mapping or directly).

    Raises:
        ValueError: naming the loop, the key, the bad value and what is accepted.
    """

    LOOP_NAME: ClassVar[str] = "tool loop"
    """The loop's registered name, for error messages."""

    response_length: int = loop_setting(DEFAULT_RESPONSE_LENGTH, positive=True)
    """Token budget for everything after the prompt: generated, tool and user tokens (the
    trainer's ``data.max_response_length``; the default is
    ``agentloop_core.DEFAULT_RESPONSE_LENGTH``)."""
    prompt_length: int | None = loop_setting(None, positive=True)
    """Longest accepted rendered prompt, in tokens; None: no limit."""
    max_assistant_turns: int | None = loop_setting(None, positive=True)
    """Most model turns; None: bounded only by ``response_length`` (and the loop's own limits)."""
    tool_parser: str = DEFAULT_TOOL_PARSER
    """Name of the tool-call parser (see ``agentloop_core.parsers.tool_parser_names()``)."""
    reasoning_parser: str | None = None
    """Name of the reasoning parser that splits each turn into reasoning and content before the
    tool parser reads it (``qwen3``, ``deepseek_r1``, ``gpt_oss``; see
    ``agentloop_core.reasoning.reasoning_parser_names()``); None: the tool parser reads the whole
    turn. Only what runs changes: the trajectory keeps every generated token."""
    tool_calls_in_reasoning: bool = False
    """Run the calls the model writes inside its reasoning too (with ``reasoning_parser`` set);
    False: they are counted (``tool_calls_in_reasoning_ignored``) and not run."""
    max_parallel_calls: int = loop_setting(4, positive=True)
    """Most tool calls run (concurrently) per turn; later calls of the turn get an error message."""
    max_tool_response_length: int | None = loop_setting(1024, positive=True)
    """Most characters of one tool response shown to the model; None: no character limit."""
    max_tool_response_tokens: int | None = loop_setting(None, positive=True)
    """Most tokens of one tool response shown to the model, counted with the loop's tokenizer
    (the text on its own, marker included; the chat template's wrapping of the tool message is
    not counted); None: no token limit. Applied after ``max_tool_response_length`` when both
    are set, on the same side (``tool_response_truncate_side``)."""
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
    apply_chat_template_kwargs: tuple[tuple[str, Any], ...] = loop_setting((), mapping=True)
    """Extra keyword arguments for the chat template (e.g. ``enable_thinking``), as pairs."""
    use_inference_chat_template: bool = False
    """Render history with the inference template even when it strips reasoning."""
    delta_strategy: Literal["auto", "history", "short"] = "auto"
    """How tool results and user turns are tokenized after a generated turn; see
    ``ChatRenderer(delta_strategy=)``. ``auto`` costs the same at turn 100 as at turn 1."""
    allow_special_tokens_in_content: bool = False
    """Encode special-token strings inside messages (tool results, observations, user turns,
    the prompt) as the control tokens, as verl and vLLM do; False: as text, so outside text
    cannot open a turn of its own. See ``ChatRenderer(allow_special_tokens_in_content=)``."""
    max_images: int = loop_setting(_IMAGE_DEFAULTS.max_images, positive=True)
    """Most images in one trajectory, the prompt's and those tools return together; a tool image
    past it is refused with error text for the model (``tool_images_refused``)."""
    max_image_pixels: int = loop_setting(_IMAGE_DEFAULTS.max_pixels, positive=True)
    """Most pixels (width x height) one image may declare, checked on its header before any
    pixel is decoded (a decompression bomb is refused for the cost of its header)."""
    max_image_bytes: int = loop_setting(_IMAGE_DEFAULTS.max_bytes, positive=True)
    """Most encoded bytes of one image."""
    tools: Any = None
    """The loop's tools: a dict name -> ``BaseTool`` or a list of them; None: loaded from
    ``tool_config_path`` / ``function_tool_path`` (see :func:`resolve_tools`)."""
    tool_config_path: str | None = None
    """Tool YAML (native, function and MCP tools; see ``agentloop_tools.load_tools``)."""
    function_tool_path: str | None = None
    """Python file whose module-level ``@function_tool`` functions become tools."""

    def __post_init__(self) -> None:
        _check_fields(self, self.LOOP_NAME, _rules(type(self)))

    @classmethod
    def from_mapping(cls: type[_Config], config: Mapping[str, Any]) -> _Config:
        """Read and check the loop's keys; other keys are ignored.

        Raises:
            ValueError: naming the key, the bad value and what is accepted.
        """
        return read_loop_config(cls, config)


@dataclass(frozen=True)
class ToolAgentConfig(ToolLoopConfig):
    """The ``tool_agent`` keys of the rollout config (other keys are ignored)."""

    LOOP_NAME: ClassVar[str] = "tool_agent"

    max_user_turns: int | None = loop_setting(None, positive=True)
    """Most interaction replies; None: until the interaction ends the conversation."""
    scoring_timeout_s: float | None = loop_setting(300.0, positive=True)
    """The most seconds one call of the interaction (``start``, ``generate_response``,
    ``calculate_score``) or of a tool's ``calc_reward`` may take; past it the sample fails with
    a ``CallTimeoutError`` naming the call and this key, and the batch goes on. None: no limit."""
    interaction: Any = None
    """A :class:`~agentloop_tools.interaction.BaseInteraction`, ``{"class_name", "config",
    "name"}`` or a list of those (see :func:`resolve_interactions`); None: none, or
    ``interaction_config_path``."""
    interaction_config_path: str | None = None
    """verl's interaction YAML (a simulated user that replies when the model stops calling tools)."""


def read_loop_config(cls: type, config: Mapping[str, Any], *, loop_name: str | None = None) -> Any:
    """Build a loop's frozen config dataclass from a mapping and check it.

    Keys the dataclass does not name are ignored (the mapping is the rollout's
    ``loop_mapping``, shared by every loop); a None value keeps the default unless the
    field's type admits None.

    Args:
        cls: The loop's config class: a :class:`ToolLoopConfig` subclass, or any dataclass
            (checked the same way, from its fields' types and :func:`loop_setting`).
        config: The mapping to read.
        loop_name: For messages; default: ``cls.LOOP_NAME``.

    Raises:
        ValueError: naming the loop, the key, the bad value and what is accepted.
        TypeError: ``cls`` is not a dataclass.
    """
    _require_dataclass(cls)
    rules = _rules(cls)
    data = {}
    for rule in rules:
        if rule.name in config and (config[rule.name] is not None or rule.nullable):
            data[rule.name] = config[rule.name]
    cfg = cls(**data)
    if not isinstance(cfg, ToolLoopConfig):  # tool loop configs check themselves
        _check_fields(cfg, loop_name or getattr(cls, "LOOP_NAME", cls.__name__), rules)
    return cfg


def _require_dataclass(config_class: Any) -> None:
    if not (isinstance(config_class, type) and dataclasses.is_dataclass(config_class)):
        raise TypeError(f"config_class must be a dataclass type, got {config_class!r}")


# Keyed by the configured paths (values, not object ids, so a key cannot be reused for something
# else) and kept for the process on purpose: the trainer and every loop share one set of tools.
# A process configures a handful of paths, so these stay small.
_TOOL_CACHE: dict[tuple[str | None, str | None], dict[str, BaseTool]] = {}


def _reader(config: Any) -> Any:
    """``get(key)`` of a mapping or of a loop's config object."""
    if isinstance(config, Mapping):
        return config.get
    return lambda key: getattr(config, key, None)


def resolve_tools(config: Mapping[str, Any] | ToolLoopConfig) -> dict[str, BaseTool]:
    """The loop's tools: ``tools`` (dict name -> BaseTool, or a list), else
    ``load_tools(tool_config_path, function_tool_path)``, loaded once per process and shared
    (per-trajectory state lives in tool instances, not in the tool objects).

    Args:
        config: A loop's config (:class:`ToolLoopConfig`) or a mapping with those keys.

    Raises:
        ValueError: a tool is not a BaseTool or its key differs from its name.
    """
    get = _reader(config)
    tools = get("tools")
    if tools is None:
        paths = (get("tool_config_path"), get("function_tool_path"))
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


def resolve_interactions(config: Mapping[str, Any] | ToolAgentConfig) -> dict[str, BaseInteraction]:
    """The loop's interactions by name: ``interaction`` (anything
    :func:`~agentloop_tools.interaction.load_interactions` takes), else the verl-style YAML at
    ``interaction_config_path``, loaded once per process and shared (per-trajectory state lives
    under each conversation's instance id).

    Args:
        config: A loop's config (:class:`ToolAgentConfig`) or a mapping with those keys.

    Raises:
        ValueError: both keys are set, or the spec or file is bad.
    """
    get = _reader(config)
    spec, path = get("interaction"), get("interaction_config_path")
    if spec is not None and path is not None:
        raise ValueError("loop config sets both 'interaction' and 'interaction_config_path'; keep one")
    if path is None:
        return load_interactions(spec)
    key = str(Path(path).expanduser().resolve())
    if key not in _INTERACTION_CACHE:
        _INTERACTION_CACHE[key] = load_interaction_config(key)
    return _INTERACTION_CACHE[key]
