"""What a tool loop reads from a dataset row, checked the same way by every loop that runs
tools (``tool_agent``, LangGraph's ``react_agent``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["row_messages", "row_tools_kwargs"]


def row_messages(row: Mapping[str, Any], loop_name: str) -> Any:
    """The row's ``raw_prompt``: a non-empty sequence of chat messages (parquet datasets hand
    back numpy arrays of message dicts; any non-text sequence will do).

    Raises:
        ValueError: naming the loop and what it got.
    """
    messages = row.get("raw_prompt")
    if messages is None or isinstance(messages, (str, bytes, Mapping)) or not hasattr(messages, "__len__") \
            or len(messages) == 0:
        raise ValueError(f"{loop_name} row needs 'raw_prompt': a non-empty list of chat messages, got "
                         f"{type(messages).__name__}")
    return messages


def row_tools_kwargs(row: Mapping[str, Any], tools: Mapping[str, Any]) -> dict[str, Any]:
    """The row's ``tools_kwargs`` (per tool name), every name one of ``tools``.

    Raises:
        ValueError: naming the unknown tools and the configured ones.
    """
    tools_kwargs = dict(row.get("tools_kwargs") or {})
    unknown = sorted(set(tools_kwargs) - set(tools))
    if unknown:
        raise ValueError(f"row tools_kwargs names tools {unknown} that the loop does not have; "
                         f"configured tools: {sorted(tools) or '(none)'}")
    return tools_kwargs
