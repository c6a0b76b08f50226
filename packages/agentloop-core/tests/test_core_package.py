"""The package itself: unknown names, its version."""

from __future__ import annotations

import pytest


def test_unknown_names_raise_attribute_error():
    import agentloop_core

    with pytest.raises(AttributeError, match="no attribute 'NoSuchName'"):
        _ = agentloop_core.NoSuchName


def test_version_is_the_pyproject_version():
    """``__version__`` is read from the installed distribution, whose one source is
    pyproject.toml: a stale install (or a second hand-written version) fails here."""
    from pathlib import Path

    import tomllib

    import agentloop_core

    pyproject = Path(__file__).resolve().parents[1] / "pyproject.toml"
    assert agentloop_core.__version__ == tomllib.loads(pyproject.read_text())["project"]["version"]
