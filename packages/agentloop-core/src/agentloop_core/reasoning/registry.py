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

from agentloop_core.plugins import InvalidPluginError, PluginRegistry, UnknownPluginError
from agentloop_core.reasoning.base import ReasoningParser

ENTRY_POINT_GROUP = "agentloop.reasoning_parsers"

P = TypeVar("P", bound="type[ReasoningParser]")


class UnknownReasoningParserError(UnknownPluginError):
    """No reasoning parser is registered under the requested name."""


def _adopt(name: str, cls: object) -> type[ReasoningParser]:
    if not (isinstance(cls, type) and issubclass(cls, ReasoningParser)):
        raise InvalidPluginError(f"is not an agentloop_core.reasoning.ReasoningParser subclass (got {cls!r}); "
                                 "point it at the parser class")
    own = cls.__dict__.get("name")  # a subclass inherits its parent's name; only its own counts
    if own and own != name:
        raise InvalidPluginError(f"holds the reasoning parser named {own!r}; the entry-point name and the name "
                                 "the class registers must agree")
    cls.name = name
    return cls


PARSERS: PluginRegistry[type[ReasoningParser]] = PluginRegistry(
    "reasoning parser", ENTRY_POINT_GROUP, error=UnknownReasoningParserError, adopt=_adopt,
    how_to_add=lambda name: (
        "Set multi_turn.reasoning_parser to one of them (null: no reasoning split). Add one by subclassing "
        "agentloop_core.reasoning.ReasoningParser and decorating it with "
        f"@agentloop_core.reasoning.register_reasoning_parser({name!r}), or, from an installed package, with "
        f"an entry point in the {ENTRY_POINT_GROUP!r} group naming the class (docs/tool-parsers.md)."))
"""The reasoning parser classes by name (the helper every registry shares)."""
_INSTANCES: dict[str, ReasoningParser] = {}


def register_reasoning_parser(name: str, *, aliases: Sequence[str] = ()) -> Callable[[P], P]:
    """Register a :class:`~agentloop_core.reasoning.base.ReasoningParser` subclass under ``name``
    (and ``aliases``, which resolve to the same shared instance).

    Raises:
        ValueError: if another class already holds the name or one of the aliases.
    """

    def decorator(cls: P) -> P:
        PARSERS.add(name, cls, aliases=aliases)
        cls.name = name
        return cls

    return decorator


def reasoning_parser_names() -> list[str]:
    """Every name :func:`get_reasoning_parser` accepts, aliases and installed plug-ins included."""
    return PARSERS.names()


def get_reasoning_parser(name: str) -> ReasoningParser:
    """The shared (stateless) parser instance for ``name``.

    Raises:
        UnknownReasoningParserError: listing the known names and how to add one.
    """
    cls = PARSERS.get(name)
    parser = _INSTANCES.get(cls.name)
    if parser is None or type(parser) is not cls:  # none yet, or the name holds another class now
        parser = _INSTANCES[cls.name] = cls()
    return parser


__all__ = ["ENTRY_POINT_GROUP", "PARSERS", "UnknownReasoningParserError", "get_reasoning_parser", "reasoning_parser_names",
           "register_reasoning_parser"]
