"""Reasoning parsers by name: :func:`register_reasoning_parser` in code, or the
``agentloop.reasoning_parsers`` entry-point group for installed packages::

    [project.entry-points."agentloop.reasoning_parsers"]
    my_thoughts = "my_pkg.reasoning:MyThoughtsReasoningParser"

The entry point names a :class:`~agentloop_core.reasoning.base.ReasoningParser` subclass; its
name is the entry-point name (a class decorated with :func:`register_reasoning_parser` must use
the same).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

from agentloop_core.plugins import NamedClassRegistry, UnknownPluginError
from agentloop_core.reasoning.base import ReasoningParser

ENTRY_POINT_GROUP = "agentloop.reasoning_parsers"

P = TypeVar("P", bound="type[ReasoningParser]")


class UnknownReasoningParserError(UnknownPluginError):
    """No reasoning parser is registered under the requested name."""


PARSERS: NamedClassRegistry[type[ReasoningParser]] = NamedClassRegistry(
    "reasoning parser", ENTRY_POINT_GROUP, ReasoningParser, base_path="agentloop_core.reasoning.ReasoningParser", error=UnknownReasoningParserError,
    how_to_add=lambda name: (
        "Set multi_turn.reasoning_parser to one of them (null: no reasoning split). Add one by subclassing "
        "agentloop_core.reasoning.ReasoningParser and decorating it with "
        f"@agentloop_core.reasoning.register_reasoning_parser({name!r}), or, from an installed package, with "
        f"an entry point in the {ENTRY_POINT_GROUP!r} group naming the class (docs/tool-parsers.md)."))
"""The reasoning parser classes by name (the helper every registry shares)."""


def register_reasoning_parser(name: str, *, aliases: Sequence[str] = ()) -> Callable[[P], P]:
    """Register a :class:`~agentloop_core.reasoning.base.ReasoningParser` subclass under ``name``
    (and ``aliases``, which resolve to the same shared instance).

    Raises:
        ValueError: if another class already holds the name or one of the aliases.
    """

    return PARSERS.register(name, aliases=aliases)


def reasoning_parser_names() -> list[str]:
    """Every name :func:`get_reasoning_parser` accepts, aliases and installed plug-ins included."""
    return PARSERS.names()


def get_reasoning_parser(name: str) -> ReasoningParser:
    """The shared (stateless) parser instance for ``name``.

    Raises:
        UnknownReasoningParserError: listing the known names and how to add one.
    """
    return PARSERS.instance(name)


__all__ = ["ENTRY_POINT_GROUP", "PARSERS", "UnknownReasoningParserError", "get_reasoning_parser", "reasoning_parser_names",
           "register_reasoning_parser"]
