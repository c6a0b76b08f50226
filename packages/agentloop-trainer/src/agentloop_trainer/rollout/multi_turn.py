"""The ``actor_rollout_ref.rollout.multi_turn`` section (verl's layout): the tool loops' keys,
derived from the loops' own config instead of listed a second time.

:class:`~agentloop_tools.loop_config.ToolAgentConfig` declares each tool-loop key once, with its
type, default and doc. The section carries the ones named in :data:`MULTI_TURN_LOOP_KEYS`
(generated fields: the loop's type, OmegaConf's spelling of it, and the loop's default), plus
the trainer's own keys declared below. The rollout hands them to the loops under the same
names (:func:`loop_options`), so a key, its default and its doc live in one place.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Optional, Union

from agentloop_tools.loop_config import ToolAgentConfig

__all__ = ["MULTI_TURN_LOOP_KEYS", "MultiTurnSection", "loop_options"]

MULTI_TURN_LOOP_KEYS: tuple[str, ...] = (
    "max_assistant_turns", "max_user_turns", "allow_special_tokens_in_content", "max_parallel_calls",
    "max_tool_response_length", "max_tool_response_tokens", "tool_response_truncate_side",
    "tool_config_path", "function_tool_path", "interaction_config_path", "tool_parser",
    "reasoning_parser", "tool_calls_in_reasoning", "tool_timeout_s",
)
"""Which of :class:`~agentloop_tools.loop_config.ToolAgentConfig`'s fields the section carries
(verl's ``multi_turn`` keys and agentloop's tool keys). The loop's other fields come from other
sections (``response_length``: ``data.max_response_length``; ``prompt_length``:
``data.max_prompt_length``; ``sanity_check``: ``rollout.sanity_check``; ``tool_reward``:
``reward.source``) or per loop (``rollout.agent.loops.<name>.<key>``)."""

DOC_SOURCE = "doc_from"
"""Field metadata key of a generated field: the class whose attribute docstring documents it
(read by the config reference, ``tools/docs/config_reference.py``)."""


def _yaml_type(hint: Any) -> Any:
    """The loop field's type as OmegaConf takes it: a ``Literal`` of strings as ``str`` (OmegaConf
    has no ``Literal``; the loop config checks the choice when it is built), ``X | None`` as
    ``Optional[X]``."""
    args = typing.get_args(hint)
    nullable = typing.get_origin(hint) in (Union, types.UnionType) and type(None) in args
    (kind,) = [a for a in args if a is not type(None)] if nullable else [hint]
    if typing.get_origin(kind) is Literal:
        kind = type(typing.get_args(kind)[0])
    return Optional[kind] if nullable else kind  # noqa: UP045 - a runtime type object for OmegaConf


def _with_tool_loop_keys(cls: type) -> type:
    """Add to ``cls`` (before ``@dataclass``) a field for each of :data:`MULTI_TURN_LOOP_KEYS` it
    does not declare itself, typed and defaulted as :class:`ToolAgentConfig`'s field."""
    hints = typing.get_type_hints(ToolAgentConfig)
    loop_fields = {f.name: f for f in dataclasses.fields(ToolAgentConfig)}
    annotations = dict(cls.__dict__.get("__annotations__", {}))
    for name in MULTI_TURN_LOOP_KEYS:
        if name in annotations:
            continue
        default = loop_fields[name].default
        if default is dataclasses.MISSING or isinstance(default, (list, dict, set)):
            raise TypeError(f"ToolAgentConfig.{name} has no immutable default; the multi_turn section cannot carry it")
        annotations[name] = _yaml_type(hints[name])
        setattr(cls, name, dataclasses.field(default=default, metadata={DOC_SOURCE: ToolAgentConfig}))
    cls.__annotations__ = annotations
    return cls


@dataclass
@_with_tool_loop_keys
class MultiTurnSection:
    """Multi-turn settings of the tool loops (verl: ``rollout.multi_turn``): the trainer's keys
    below, then each of :data:`MULTI_TURN_LOOP_KEYS` with the tool loops' type, default and doc
    (``agentloop_tools.loop_config.ToolAgentConfig``), reaching the loops under the same name."""

    enable: bool = True
    """verl's switch; agentloop's loops are always multi-turn (false is an error)."""
    max_tokens_per_turn: int = 64
    """Most tokens one assistant turn may generate: the rollout's ``SamplingParams.max_tokens``."""
    max_assistant_turns: int | None = 3
    """Most model turns per trajectory; null: bounded by the response budget. The trainer's
    choice (the loop's own default is null): the built-in task needs two or three."""

    if TYPE_CHECKING:
        # The generated fields, for readers of the section (``mt.tool_parser``): their types are
        # the loop config's; OmegaConf checks every key and value at load.
        def __getattr__(self, name: str) -> Any: ...


def loop_options(section: MultiTurnSection) -> dict[str, Any]:
    """The section's tool-loop keys by name, as the loops read them (every one of
    :data:`MULTI_TURN_LOOP_KEYS`, the trainer's own keys left out)."""
    return {name: getattr(section, name) for name in MULTI_TURN_LOOP_KEYS}
