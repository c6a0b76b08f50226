"""Tool-call parsers by name: :func:`register_tool_parser` in code, or the
``agentloop.tool_parsers`` entry-point group for installed packages::

    [project.entry-points."agentloop.tool_parsers"]
    my_format = "my_pkg.parser:MyFormatToolParser"

The entry point names a :class:`~agentloop_core.parsers.base.ToolParser` subclass; its name is
the entry-point name (a class decorated with :func:`register_tool_parser` must use the same).
What the gateway needs to stream the parser's answers is declared on the class
(:attr:`~agentloop_core.parsers.base.ToolParser.call_openings`), so a plug-in needs nothing
registered anywhere else.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

from agentloop_core.parsers.base import ToolParser
from agentloop_core.plugins import NamedClassRegistry, UnknownPluginError

ENTRY_POINT_GROUP = "agentloop.tool_parsers"

DEFAULT_TOOL_PARSER = "hermes"
"""The tool-call parser of every loop, gateway and chat model that is not told another (the
tool loops' ``tool_parser``, ``http_agent``'s, LangGraph's ``AgentLoopChatModel``, the
conformance suite's profile): declared once here, imported everywhere else."""

P = TypeVar("P", bound="type[ToolParser]")


class UnknownToolParserError(UnknownPluginError):
    """No tool-call parser is registered under the requested name."""


PARSERS: NamedClassRegistry[type[ToolParser]] = NamedClassRegistry(
    "tool parser", ENTRY_POINT_GROUP, ToolParser, base_path="agentloop_core.parsers.ToolParser", error=UnknownToolParserError,
    how_to_add=lambda name: (
        "Add one by subclassing agentloop_core.parsers.ToolParser and decorating it with "
        f"@agentloop_core.parsers.register_tool_parser({name!r}), or, from an installed package, with an "
        f"entry point in the {ENTRY_POINT_GROUP!r} group naming the class (docs/tool-parsers.md)."))
"""The tool-call parser classes by name (the helper every registry shares)."""


def register_tool_parser(name: str, *, aliases: Sequence[str] = ()) -> Callable[[P], P]:
    """Register a :class:`~agentloop_core.parsers.base.ToolParser` subclass under ``name``.

    Args:
        name: The parser's name (also set as the class's ``name``).
        aliases: Other names that resolve to the same parser and the same shared instance
            (``harmony`` for ``gpt_oss``: one format, known by the model family and by its own name).

    Raises:
        ValueError: if another class already holds the name or one of the aliases.
    """

    return PARSERS.register(name, aliases=aliases)


def tool_parser_names() -> list[str]:
    """Every name ``get_tool_parser`` accepts, aliases and installed plug-ins included."""
    return PARSERS.names()


def get_tool_parser(name: str) -> ToolParser:
    """The shared parser instance for ``name`` (parsers are stateless apart from their
    counters, which are meant to aggregate over all trajectories).

    Raises:
        UnknownToolParserError: listing the known names and how to add one.
    """
    return PARSERS.instance(name)


__all__ = ["ENTRY_POINT_GROUP", "PARSERS", "UnknownToolParserError", "get_tool_parser", "register_tool_parser",
           "tool_parser_names"]
