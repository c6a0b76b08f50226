"""How a long tool response is cut before the model reads it; shared by every loop that runs
tools (``tool_agent``, LangGraph's ``react_agent``)."""

from __future__ import annotations

from typing import Literal

__all__ = ["TRUNCATION_MARKER", "TruncateSide", "truncate_text"]

TruncateSide = Literal["left", "right", "middle"]
"""Which part of a long text to keep: ``left`` keeps the tail, ``right`` the head, ``middle``
head and tail."""

TRUNCATION_MARKER = "...(truncated)..."
"""Written where text was cut, so the model knows the response is incomplete."""


def truncate_text(text: str, limit: int, side: TruncateSide) -> str:
    """Keep at most ``limit`` characters of ``text``, marking the cut.

    Args:
        text: The tool response.
        limit: Characters of ``text`` to keep.
        side: ``left`` keeps the tail, ``right`` the head, ``middle`` both ends.

    Returns:
        ``text`` itself when it fits, else the kept part(s) joined by :data:`TRUNCATION_MARKER`.
    """
    if len(text) <= limit:
        return text
    if side == "left":
        return TRUNCATION_MARKER + text[len(text) - limit :]
    if side == "right":
        return text[:limit] + TRUNCATION_MARKER
    head = limit // 2
    return text[:head] + TRUNCATION_MARKER + text[len(text) - (limit - head) :]
