"""The migration guide is what its generator writes from the loader's tables: a table changed
without rerunning ``python tools/docs/verl_migration.py`` fails here."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools" / "docs"))

import verl_migration  # noqa: E402  # pyright: ignore[reportMissingImports]


def test_the_page_is_generated_from_the_tables() -> None:
    assert verl_migration.PAGE.read_text() == verl_migration.render(), (
        "docs/migrate-from-verl.md differs from the tables; run: python tools/docs/verl_migration.py")


def test_every_table_entry_is_on_the_page() -> None:
    from agentloop_trainer.config import verl_compat

    page = verl_migration.PAGE.read_text()
    keys = [*verl_compat.RENAMED, *verl_compat.SPLIT, *verl_compat.ONLY_VALUE, *verl_compat.NO_EFFECT,
            *verl_compat.VERL_TOOL_CLASSES, *verl_compat.VERL_BASE_CONFIGS]
    assert [k for k in keys if f"`{k}`" not in page] == []


def test_a_changed_table_changes_the_page(monkeypatch: pytest.MonkeyPatch) -> None:
    from agentloop_trainer.config import verl_compat

    monkeypatch.setitem(verl_compat.RENAMED, "trainer.brand_new_verl_key", "trainer.total_steps")
    assert "| `trainer.brand_new_verl_key` | `trainer.total_steps` |" in verl_migration.render()


def test_the_page_is_in_the_guides() -> None:
    mkdocs = (Path(__file__).resolve().parents[2] / "mkdocs.yml").read_text()
    guides = mkdocs.split("  - Guides:", 1)[1].split("  - Reference:", 1)[0]
    assert "migrate-from-verl.md" in guides
