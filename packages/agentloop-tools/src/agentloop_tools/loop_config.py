"""Config of the tool loops: the ``tool_agent`` keys, the readers every tool loop shares (the
dataclass reader, :func:`resolve_tools`, :func:`resolve_interactions`), and the check a trainer
runs on a user's per-loop config section.

A loop's config is a frozen dataclass (its ``config_class``) read from the rollout config, whose
other keys are ignored because the worker passes its whole config to every loop. A trainer that
holds a section meant for one loop can still reject typos with :func:`check_loop_config_keys`:
the valid keys are the dataclass fields plus the class's ``EXTRA_KEYS``, the keys the loop reads
outside the dataclass (tool and interaction sources).
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal

from agentloop_tools.base import BaseTool
from agentloop_tools.interaction import BaseInteraction, load_interaction_config, load_interactions

__all__ = [
    "LOOP_CONFIG_CHOICES",
    "ToolAgentConfig",
    "TruncateSide",
    "check_loop_config_keys",
    "loop_config_keys",
    "read_loop_config",
    "resolve_interactions",
    "resolve_tools",
]

TruncateSide = Literal["left", "right", "middle"]


@dataclass(frozen=True)
class ToolAgentConfig:
    """The ``tool_agent`` keys of the rollout config (other keys are ignored)."""

    EXTRA_KEYS: ClassVar[tuple[str, ...]] = (
        "tools", "tool_config_path", "function_tool_path", "interaction", "interaction_config_path")
    """Keys the loop reads outside this dataclass: its tools (``resolve_tools``) and its
    interactions (``resolve_interactions``)."""

    response_length: int = 1024
    """Token budget for everything after the prompt: generated, tool and user tokens."""
    prompt_length: int | None = None
    """Longest accepted rendered prompt, in tokens; None: no limit."""
    tool_parser: str = "hermes"
    """Name of the tool-call parser (see ``agentloop_core.parsers.tool_parser_names()``)."""
    max_assistant_turns: int | None = None
    """Most model turns; None: bounded only by ``response_length``."""
    max_user_turns: int | None = None
    """Most interaction replies; None: until the interaction ends the conversation."""
    max_parallel_calls: int = 4
    """Most tool calls run (concurrently) per turn; later calls get an error message."""
    max_tool_response_length: int = 1024
    """Most characters of one tool response shown to the model."""
    tool_response_truncate_side: TruncateSide = "middle"
    """Which part of a long response to keep: ``left`` keeps the tail, ``right`` the head,
    ``middle`` head and tail."""
    tool_timeout_s: float | None = 60.0
    """Time limit of one tool call unless the tool sets its own ``timeout_s``; None: no limit."""
    tool_reward: Literal["sum", "none"] = "sum"
    """``sum``: reward_score = step rewards of every call + each tool's ``calc_reward`` + the
    interaction's ``calculate_score``; ``none``: reward_score is None (the trainer computes it)."""
    sanity_check: Literal["strict", "ignore_strippable", "disable"] = "strict"
    """Delta-tokenization check against full re-tokenization, see ``Trajectory.to_output``."""
    apply_chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    """Extra keyword arguments for the chat template (e.g. ``enable_thinking``)."""
    use_inference_chat_template: bool = False
    """Render history with the inference template even when it strips reasoning."""
    delta_strategy: Literal["auto", "history", "short"] = "auto"
    """How tool results and user turns are tokenized after a generated turn; see
    ``ChatRenderer(delta_strategy=)``. ``auto`` costs the same at turn 100 as at turn 1."""

    @classmethod
    def from_mapping(cls, config: Mapping[str, Any]) -> ToolAgentConfig:
        """Read and check the loop's keys.

        Raises:
            ValueError: naming the key, the bad value and what is accepted.
        """
        cfg = read_loop_config(
            cls, config, loop_name="tool_agent",
            nullable=("max_assistant_turns", "max_user_turns", "prompt_length", "tool_timeout_s"),
            positive=("response_length", "max_parallel_calls", "max_tool_response_length", "prompt_length",
                      "max_assistant_turns", "max_user_turns"),
        )
        if cfg.tool_timeout_s is not None and not (isinstance(cfg.tool_timeout_s, (int, float)) and cfg.tool_timeout_s > 0):
            raise ValueError(f"tool_agent config tool_timeout_s must be a positive number or None, got {cfg.tool_timeout_s!r}")
        return cfg


# Choice-valued keys shared by every loop that runs tools (tool_agent, react_agent).
LOOP_CONFIG_CHOICES: dict[str, tuple[str, ...]] = {
    "tool_response_truncate_side": ("left", "right", "middle"),
    "tool_reward": ("sum", "none"),
    "sanity_check": ("strict", "ignore_strippable", "disable"),
    "delta_strategy": ("auto", "history", "short"),
}


def read_loop_config(cls: type, config: Mapping[str, Any], *, loop_name: str, nullable: tuple[str, ...],
                     positive: tuple[str, ...]) -> Any:
    """Build a loop's frozen config dataclass from the rollout config and check it.

    Keys the dataclass does not name are ignored (the worker passes its whole config); a None
    value keeps the default unless the key is in ``nullable``.

    Raises:
        ValueError: naming the loop, the key, the bad value and what is accepted.
    """
    names = cls.__dataclass_fields__
    data = {k: config[k] for k in names if k in config and config[k] is not None}
    for key in nullable:
        if key in config and config[key] is None:
            data[key] = None
    cfg = cls(**data)
    for key in positive:
        value = getattr(cfg, key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"{loop_name} config {key} must be a positive integer, got {value!r}")
    for key, allowed in LOOP_CONFIG_CHOICES.items():
        if key in names and getattr(cfg, key) not in allowed:
            raise ValueError(f"{loop_name} config {key} must be one of {allowed}, got {getattr(cfg, key)!r}")
    return cfg


def loop_config_keys(config_class: type) -> frozenset[str]:
    """Every key a loop with this config class reads: the dataclass fields plus its
    ``EXTRA_KEYS`` (empty when the class declares none).

    Raises:
        TypeError: ``config_class`` is not a dataclass.
    """
    if not (isinstance(config_class, type) and dataclasses.is_dataclass(config_class)):
        raise TypeError(f"config_class must be a dataclass type, got {config_class!r}")
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
        if name != tool.name:
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
