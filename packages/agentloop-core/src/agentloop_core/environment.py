"""Environments: a task written as ``reset(row) -> messages`` and ``step(turn) -> StepResult``.

An environment author never touches tokens. The ``env_agent`` loop (``agentloop-tools``) owns
the trajectory: it renders what :meth:`Environment.reset` returns, generates, hands the decoded
turn (text, reasoning, parsed tool calls, token ids) to :meth:`Environment.step`, and appends
the messages the step returns with the chat template's delta tokenization (mask 0), exactly as
``tool_agent`` appends tool results. One instance serves one trajectory: built from the loop's
``environment_kwargs``, reset with the row, stepped once per assistant turn, closed at the end
(also when the trajectory fails).

Environments are found by name: ``@register_environment("name")`` in code, or the
``agentloop.environments`` entry-point group for installed packages::

    [project.entry-points."agentloop.environments"]
    number_guess = "my_pkg.games:NumberGuessEnv"
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple, TypeVar

from agentloop_core.imports import import_object
from agentloop_core.parsers.base import ToolCall, ToolCallError
from agentloop_core.plugins import InvalidPluginError, PluginRegistry, UnknownPluginError

ENTRY_POINT_GROUP = "agentloop.environments"

__all__ = [
    "ENTRY_POINT_GROUP",
    "AssistantTurn",
    "Environment",
    "EnvironmentError",
    "StepResult",
    "UnknownEnvironmentError",
    "environment_names",
    "get_environment_class",
    "register_environment",
]


@dataclass(frozen=True)
class AssistantTurn:
    """One generated assistant turn, as the environment sees it."""

    text: str
    """The turn decoded (special tokens skipped, as the tool parser read it)."""
    content: str
    """The text a reasoning parser leaves outside the reasoning; ``text`` without one."""
    reasoning: str | None
    """The reasoning the reasoning parser split off; None without one or when there was none."""
    tool_calls: tuple[ToolCall, ...] = ()
    """Calls the configured tool parser found (in ``content`` unless ``tool_calls_in_reasoning``),
    checked against the environment's :meth:`~Environment.tool_schemas`."""
    tool_call_ids: tuple[str, ...] = ()
    """The id of each call in ``tool_calls``: a tool message answering call ``i`` carries
    ``tool_call_id=tool_call_ids[i]`` (templates render a result only after its call)."""
    tool_call_errors: tuple[ToolCallError, ...] = ()
    """Calls the parser could not use; ``reason`` is written for the model."""
    error_call_ids: tuple[str, ...] = ()
    """The id of each entry of ``tool_call_errors``."""
    token_ids: tuple[int, ...] = ()
    """The generated token ids, exactly as the engine returned them."""
    stop_reason: str = "stop"
    """Why generation stopped (``stop``; ``length`` and ``aborted`` turns are not stepped)."""
    index: int = 0
    """Turn number, from 0."""


class StepResult(NamedTuple):
    """What one :meth:`Environment.step` returns; a plain 4-tuple works too."""

    messages: Sequence[Mapping[str, Any]]
    """Chat messages appended after the turn (``user`` feedback, ``tool`` results...); ignored
    when ``done`` (nothing is generated after them)."""
    reward: float
    """This step's reward; the trajectory's ``reward_score`` is the sum over steps."""
    done: bool
    """The episode is over: the loop stops."""
    info: Mapping[str, Any] = {}
    """Anything to record: numbers add up into ``metrics["env/<key>"]``, the dict goes to
    ``extra_fields["step_infos"]``."""


class Environment(abc.ABC):
    """A task as an environment. Subclass it, implement :meth:`step` (and :meth:`reset` when the
    first messages are not the row's ``raw_prompt``), and register it by name.

    Constructed once per trajectory with the loop's ``environment_kwargs`` as keyword arguments.
    An exception from any method fails the sample with the environment's name and the error (it
    is counted in the batch's ``num_failed``, never dropped); tell the model about its mistakes
    in ``messages`` instead.
    """

    name: ClassVar[str] = ""
    """The registered name (set by :func:`register_environment`)."""

    def tool_schemas(self) -> list[dict[str, Any]]:
        """OpenAI tool schemas rendered into the prompt and used to check parsed calls; none by
        default (called after :meth:`reset`)."""
        return []

    async def reset(self, row: Mapping[str, Any]) -> Sequence[Mapping[str, Any]]:
        """Start an episode from a dataset row and return its first chat messages.

        Args:
            row: The whole row: ``raw_prompt``, ``extra_info``, ``reward_model``, ``ground_truth``...

        Returns:
            The messages the model sees first; default: the row's ``raw_prompt``.
        """
        messages = row.get("raw_prompt")
        if messages is None or len(messages) == 0:
            raise ValueError(f"environment {self.name!r} resets from the row's 'raw_prompt', which is empty; "
                             "give the row a prompt or override reset()")
        return [dict(m) for m in messages]

    @abc.abstractmethod
    async def step(self, turn: AssistantTurn) -> StepResult | tuple[Any, float, bool, Mapping[str, Any]]:
        """React to one assistant turn.

        Args:
            turn: The turn, decoded and parsed (see :class:`AssistantTurn`).

        Returns:
            ``(messages, reward, done, info)``.
        """

    async def close(self) -> None:  # noqa: B027 - optional hook
        """Release what the episode holds; called once, also after a failure."""


class EnvironmentError(RuntimeError):  # noqa: A001 - the field's name; not the builtin alias
    """An environment failed (or misbehaved); the message names it and the method."""


class UnknownEnvironmentError(UnknownPluginError):
    """No environment is registered under the requested name."""


def _adopt(name: str, obj: object) -> type[Environment]:
    if not (isinstance(obj, type) and issubclass(obj, Environment)):
        raise InvalidPluginError("is not an Environment subclass")
    if not obj.name:
        obj.name = name
    return obj


_ENVIRONMENTS: PluginRegistry[type[Environment]] = PluginRegistry(
    "environment", ENTRY_POINT_GROUP, error=UnknownEnvironmentError, adopt=_adopt,
    how_to_add=lambda name: (f"Register one with @agentloop_core.environment.register_environment({name!r}), an "
                             f"entry point in the {ENTRY_POINT_GROUP!r} group, or name it by import path "
                             "'pkg.module:Class'."))
E = TypeVar("E", bound="type[Environment]")


def register_environment(name: str) -> Callable[[E], E]:
    """Register an :class:`Environment` subclass under ``name``.

    Raises:
        ValueError: another class holds the name, or the class is not an Environment.
    """

    def decorator(cls: E) -> E:
        if not (isinstance(cls, type) and issubclass(cls, Environment)):
            raise ValueError(f"environment {name!r}: {cls!r} is not an Environment subclass")
        _ENVIRONMENTS.add(name, cls)
        cls.name = name
        return cls

    return decorator


def environment_names() -> list[str]:
    """All known environment names, entry points included."""
    return _ENVIRONMENTS.names()


def get_environment_class(name: str) -> type[Environment]:
    """Look up an environment class by name; ``pkg.module:Class`` works too.

    Raises:
        UnknownEnvironmentError: listing the known names and how to add one.
    """
    if ":" in name and name not in _ENVIRONMENTS.entries:
        cls = import_object(name, where="environment")
        if not (isinstance(cls, type) and issubclass(cls, Environment)):
            raise UnknownEnvironmentError(f"environment {name!r} is not an Environment subclass")
        return cls
    return _ENVIRONMENTS.get(name)
