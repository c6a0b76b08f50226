"""The trainer's rooms are layered: a room imports only rooms below it, at module level and
inside functions alike (a function-level import is still an arrow; hiding one there is how
two-way ties crept in). The order lives here, once, and in the trainer README's "Rooms" section.

A failure names the importing module and line, and the two rooms. The fix is to move the
shared piece down (a section into the room that owns it, a helper into the lower room), or
to pass the fact the lower room needs as a plain argument from the driver above it.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import agentloop_trainer

ROOM_ORDER: tuple[str, ...] = (
    "reward", "loggers", "view", "task", "data", "rollout", "update", "checkpoint", "policy", "eval", "pretrained",
    "config", "stages", "cli",
)
"""Lowest first. The base rooms (``reward`` ... ``pretrained``) each declare their own config
sections; ``config`` composes them into ``TrainConfig`` and loads it; ``stages`` are the drivers
that take the whole ``TrainConfig``; ``cli`` is the command line on top."""

FLOOR = ("config_base",)
"""Package-root modules below every room (``agentloop_trainer/<name>.py``): any room may import
them, and they import no room."""

PACKAGE = Path(agentloop_trainer.__file__).parent


@dataclass(frozen=True)
class Arrow:
    """One import of a trainer module by another."""

    source: str
    """The importing file, relative to the package (``rollout/engines.py``)."""
    line: int
    target: str
    """The imported module (``agentloop_trainer.config.sections``)."""


def _imported(node: ast.Import | ast.ImportFrom) -> list[str]:
    if isinstance(node, ast.ImportFrom):
        return [node.module] if node.module and node.level == 0 else []
    return [alias.name for alias in node.names]


def trainer_arrows(package: Path = PACKAGE) -> list[Arrow]:
    """Every import of an ``agentloop_trainer`` module in the package, at any depth of the file
    (module level, ``if TYPE_CHECKING:`` blocks, function bodies)."""
    arrows = []
    for path in sorted(package.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            for name in _imported(node):
                if name.startswith("agentloop_trainer."):
                    arrows.append(Arrow(path.relative_to(package).as_posix(), node.lineno, name))
    return arrows


def room_of(relative: str) -> str | None:
    """The room of a file (its first folder), or None for a package-root module."""
    parts = relative.split("/")
    return parts[0] if len(parts) > 1 else None


def upward_arrows(arrows: list[Arrow]) -> list[str]:
    """The arrows that run from a room to a room above it, or from the floor into any room."""
    rank = {room: i for i, room in enumerate(ROOM_ORDER)}
    bad = []
    for arrow in arrows:
        target = arrow.target.split(".")[1]
        source = room_of(arrow.source)
        if source is None:
            if Path(arrow.source).stem in FLOOR and target not in FLOOR:
                bad.append(f"{arrow.source}:{arrow.line} (the floor) imports {arrow.target}")
            continue
        if target in FLOOR or target == source or target not in rank:
            continue
        if rank[target] > rank[source]:
            bad.append(f"{arrow.source}:{arrow.line} ({source}) imports {arrow.target} ({target}, above it)")
    return bad


def test_every_room_has_its_place_in_the_order() -> None:
    """A new room folder gets a place in :data:`ROOM_ORDER` (and in the README's list)."""
    rooms = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").is_file()}
    assert rooms - set(ROOM_ORDER) == set(), "add each new room to ROOM_ORDER, below the rooms that import it"
    assert set(ROOM_ORDER) - rooms == set(), "a room of ROOM_ORDER is gone: drop it from the order"
    floor = {p.stem for p in PACKAGE.glob("*.py") if p.stem != "__init__"}
    assert floor == set(FLOOR), "a package-root module is either in FLOOR (imports no room) or belongs in a room"


def test_no_room_imports_a_room_above_it() -> None:
    """Zero upward arrows, module-level and function-level alike."""
    arrows = trainer_arrows()
    assert len(arrows) > 100  # the walk found the package's imports
    assert upward_arrows(arrows) == []


def test_an_upward_import_inside_a_function_is_caught(tmp_path: Path) -> None:
    """The check sees through a function-level import (the way two-way ties were hidden) and a
    ``TYPE_CHECKING`` block, and it lets a downward import through."""
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "records.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "from agentloop_trainer.task.calculator import make_problems\n"
        "if TYPE_CHECKING:\n"
        "    from agentloop_trainer.config.sections import TrainConfig\n"
        "def load():\n"
        "    from agentloop_trainer.rollout.run_config import tool_schemas\n")
    (tmp_path / "config_base.py").write_text("import agentloop_trainer.update.settings\n")
    found = upward_arrows(trainer_arrows(tmp_path))
    assert found == [
        "config_base.py:1 (the floor) imports agentloop_trainer.update.settings",
        "data/records.py:4 (data) imports agentloop_trainer.config.sections (config, above it)",
        "data/records.py:6 (data) imports agentloop_trainer.rollout.run_config (rollout, above it)",
    ]


def test_base_rooms_take_sections_not_the_whole_config() -> None:
    """Only the composing layers (``config``, ``stages``, ``cli``) name ``TrainConfig``: a room
    below them takes its section and plain facts."""
    base = ROOM_ORDER[:ROOM_ORDER.index("config")]
    named = []
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE).as_posix()
        if room_of(relative) in base and "TrainConfig" in path.read_text(encoding="utf-8"):
            named.append(relative)
    assert named == []
