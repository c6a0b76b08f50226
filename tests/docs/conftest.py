"""Fixtures of the documentation tests: one working folder per page, shared by its blocks."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
LINKED = ("examples", "packages", "conformance", "docs")
"""Repository folders a page's commands may name, linked into its working folder."""


@pytest.fixture(scope="session")
def page_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Page name -> its working folder (made on first use)."""
    return {}


@pytest.fixture
def page_dir(request: pytest.FixtureRequest, page_dirs: dict[str, Path],
             tmp_path_factory: pytest.TempPathFactory) -> Path:
    snippet = request.node.callspec.params["snippet"]
    name = snippet.page.stem
    if name not in page_dirs:
        folder = tmp_path_factory.mktemp(name)
        for link in LINKED:
            os.symlink(REPO / link, folder / link)
        page_dirs[name] = folder
    return page_dirs[name]
