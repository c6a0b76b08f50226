"""The package itself: its version."""

from __future__ import annotations


def test_version_is_the_pyproject_version():
    """``__version__`` is read from the installed distribution, whose one source is
    pyproject.toml: a stale install (or a second hand-written version) fails here."""
    from pathlib import Path

    import tomllib

    import agentloop_langgraph

    pyproject = Path(__file__).resolve().parents[1] / "pyproject.toml"
    assert agentloop_langgraph.__version__ == tomllib.loads(pyproject.read_text())["project"]["version"]
