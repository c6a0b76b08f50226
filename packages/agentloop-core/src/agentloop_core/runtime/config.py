"""Small helpers shared by the rollout worker and manager: the loop name of each row."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


def resolve_agent_names(
    rows: Sequence[Mapping[str, Any]], default: str | None, sample_offset: int = 0
) -> list[str]:
    """The agent loop name of each row: its ``agent_name``, else ``default``.

    Raises:
        TypeError: a row is not a mapping.
        ValueError: a row has no ``agent_name`` and there is no default, naming the row.
    """
    names: list[str] = []
    for i, row in enumerate(rows):
        if not isinstance(row, Mapping):
            raise TypeError(
                f"row {sample_offset + i} is a {type(row).__name__}; each row must be a dict of "
                "loop keyword arguments (raw_prompt, agent_name, ...)"
            )
        name = row.get("agent_name") or default
        if not name:
            raise ValueError(
                f"row {sample_offset + i} has no 'agent_name' and the config has no "
                "'default_agent_loop'; add agent_name to the dataset rows or set "
                "default_agent_loop (e.g. 'single_turn_agent') in the rollout config"
            )
        names.append(str(name))
    return names
