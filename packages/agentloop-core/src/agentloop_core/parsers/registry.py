"""Tool-call parsers by name."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    from agentloop_core.parsers.base import ToolParser

_PARSERS: dict[str, type[ToolParser]] = {}
_INSTANCES: dict[str, ToolParser] = {}
_ALIASES: dict[str, str] = {}
"""Alias -> registered name."""
P = TypeVar("P", bound="type[ToolParser]")


class UnknownToolParserError(KeyError):
    """No tool-call parser is registered under the requested name."""

    def __str__(self) -> str:  # KeyError quotes its message; keep it readable
        return str(self.args[0])


def register_tool_parser(name: str, *, aliases: Sequence[str] = ()) -> Callable[[P], P]:
    """Register a :class:`~agentloop_core.parsers.base.ToolParser` subclass under ``name``.

    Args:
        name: The parser's name (also set as the class's ``name``).
        aliases: Other names that resolve to the same parser and the same shared instance
            (``harmony`` for ``gpt_oss``: one format, known by the model family and by its own name).

    Raises:
        ValueError: if another class already holds the name or one of the aliases.
    """

    def decorator(cls: P) -> P:
        for taken in (name, *aliases):
            existing = _PARSERS.get(_ALIASES.get(taken, taken))
            if existing is not None and existing is not cls:
                raise ValueError(f"tool parser name {taken!r} is already registered by "
                                 f"{existing.__module__}.{existing.__qualname__}; pick another name")
        _PARSERS[name] = cls
        for alias in aliases:
            _ALIASES[alias] = name
        cls.name = name
        return cls

    return decorator


def tool_parser_names() -> list[str]:
    """Every name ``get_tool_parser`` accepts, aliases included."""
    return sorted([*_PARSERS, *_ALIASES])


def get_tool_parser(name: str) -> ToolParser:
    """The shared parser instance for ``name`` (parsers are stateless apart from their
    counters, which are meant to aggregate over all trajectories).

    Raises:
        UnknownToolParserError: listing the known names and how to add one.
    """
    name = _ALIASES.get(name, name)
    if name not in _PARSERS:
        known = ", ".join(f"{n} (alias of {_ALIASES[n]})" if n in _ALIASES else n for n in tool_parser_names())
        raise UnknownToolParserError(
            f"unknown tool parser {name!r}; known tool parsers: {known}. "
            "Add one by subclassing agentloop_core.parsers.ToolParser and decorating it with "
            f"@agentloop_core.parsers.register_tool_parser({name!r})."
        )
    parser = _INSTANCES.get(name)
    if parser is None:
        parser = _INSTANCES[name] = _PARSERS[name]()
    return parser


__all__ = ["UnknownToolParserError", "get_tool_parser", "register_tool_parser", "tool_parser_names"]
