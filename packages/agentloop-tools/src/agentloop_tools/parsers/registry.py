"""Tool-call parsers by name."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    from agentloop_tools.parsers.base import ToolParser

_PARSERS: dict[str, type[ToolParser]] = {}
_INSTANCES: dict[str, ToolParser] = {}
P = TypeVar("P", bound="type[ToolParser]")


class UnknownToolParserError(KeyError):
    """No tool-call parser is registered under the requested name."""

    def __str__(self) -> str:  # KeyError quotes its message; keep it readable
        return str(self.args[0])


def register_tool_parser(name: str) -> Callable[[P], P]:
    """Register a :class:`~agentloop_tools.parsers.base.ToolParser` subclass under ``name``.

    Raises:
        ValueError: if another class already holds the name.
    """

    def decorator(cls: P) -> P:
        existing = _PARSERS.get(name)
        if existing is not None and existing is not cls:
            raise ValueError(f"tool parser name {name!r} is already registered by "
                             f"{existing.__module__}.{existing.__qualname__}; pick another name")
        _PARSERS[name] = cls
        cls.name = name
        return cls

    return decorator


def tool_parser_names() -> list[str]:
    """Names of all registered tool-call parsers."""
    return sorted(_PARSERS)


def get_tool_parser(name: str) -> ToolParser:
    """The shared parser instance for ``name`` (parsers are stateless apart from their
    counters, which are meant to aggregate over all trajectories).

    Raises:
        UnknownToolParserError: listing the known names and how to add one.
    """
    if name not in _PARSERS:
        raise UnknownToolParserError(
            f"unknown tool parser {name!r}; known tool parsers: {', '.join(tool_parser_names())}. "
            "Add one by subclassing agentloop_tools.parsers.ToolParser and decorating it with "
            f"@agentloop_tools.parsers.register_tool_parser({name!r})."
        )
    parser = _INSTANCES.get(name)
    if parser is None:
        parser = _INSTANCES[name] = _PARSERS[name]()
    return parser


__all__ = ["UnknownToolParserError", "get_tool_parser", "register_tool_parser", "tool_parser_names"]
