"""Values of a trajectory record the viewer does not trust: :class:`BadValue`, what the page shows
in place of a value of the wrong type, and the type tests every check uses."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

_SHOWN_CHARS = 120  # of a bad value, in the page


@dataclass(frozen=True)
class BadValue:
    """A value of a record that is not what agentloop writes there, kept to be shown marked."""

    raw: str
    """The value as JSON, cut to a length fit for the page (escaped when rendered)."""
    why: str
    """What was expected, e.g. ``not an integer token id``."""

    def __str__(self) -> str:
        return f"\u26a0 {self.raw}"


def bad_value(value: Any, why: str) -> BadValue:
    """``value`` kept as a :class:`BadValue` (its JSON cut to a length fit for the page)."""
    try:
        raw = json.dumps(value, default=str, ensure_ascii=False)
    except (ValueError, RecursionError):
        raw = repr(type(value))
    if len(raw) > _SHOWN_CHARS:
        raw = raw[:_SHOWN_CHARS] + "\u2026"
    return BadValue(raw, why)


def is_int(value: Any) -> bool:
    """An integer and not a bool (JSON ``true`` is no index)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def as_int(value: Any, default: int = 0) -> int:
    """``value`` where it is an integer, else ``default`` (for sorting and data attributes)."""
    return value if is_int(value) else default
