"""Every command and Python snippet of the documentation pages runs (or is skipped, saying why).

Blocks of one page run in order in one folder (``page_dir``), so a page can write a file in one
block and use it in the next. See :mod:`snippets` for the markers.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from snippets import Snippet, page_snippets

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"
PAGES = [*sorted(DOCS.rglob("*.md")), REPO / "README.md"]
"""The site's pages and the root README (its examples are the site's, shortened)."""
SNIPPETS = [s for page in PAGES for s in page_snippets(page)]
TIMEOUT_S = 420
"""Longest a block may run (the longest here, a short training run, takes ~40 s on 2 cores)."""


def _env(folder: Path) -> dict[str, str]:
    bin_dir = str(Path(sys.executable).parent)
    return {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
            "PYTHONPATH": str(folder), "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


def _write_files(snippet: Snippet, folder: Path) -> None:
    """Write every ``file`` block of the page up to this one (idempotent: ``-k`` on one block works)."""
    for other in page_snippets(snippet.page):
        if other.kind == "file" and other.line <= snippet.line:
            path = folder / other.arg
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(other.body, encoding="utf-8")


@pytest.mark.parametrize("snippet", [s for s in SNIPPETS if s.kind != "file"], ids=lambda s: s.id)
def test_snippet(snippet: Snippet, page_dir: Path) -> None:
    if snippet.kind == "skip":
        pytest.skip(f"{snippet.id}: {snippet.arg}")
    _write_files(snippet, page_dir)
    if snippet.lang == "python":
        cmd = [sys.executable, "-c", snippet.body]
    else:
        cmd = ["bash", "-euo", "pipefail", "-c", snippet.command()]
    proc = subprocess.run(cmd, cwd=page_dir, env=_env(page_dir), capture_output=True, text=True,
                          timeout=TIMEOUT_S, check=False)
    assert proc.returncode == 0, (
        f"{snippet.id} ({snippet.lang}) exited {proc.returncode} in {page_dir}\n--- block as run ---\n"
        f"{snippet.command() if snippet.lang != 'python' else snippet.body}\n--- stdout (tail) ---\n"
        f"{proc.stdout[-3000:]}\n--- stderr (tail) ---\n{proc.stderr[-3000:]}")


def test_every_page_has_been_read() -> None:
    """The pages exist and at least one block runs: a broken glob must not pass as "nothing to test"."""
    assert PAGES, f"no pages under {DOCS}"
    assert any(s.kind in ("run", "run-with") for s in SNIPPETS)
