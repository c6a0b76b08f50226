"""Renamed public names still work for one release and say what to use instead."""

from __future__ import annotations

import importlib

import pytest


@pytest.mark.parametrize("module", ["agentloop_langgraph", "agentloop_langgraph.messages"])
def test_rollout_limit_reached_is_an_alias_that_warns(module):
    mod = importlib.import_module(module)
    with pytest.warns(DeprecationWarning, match=r"RolloutLimitReached is deprecated.*RolloutLimitReachedError"):
        old = mod.RolloutLimitReached
    assert old is mod.RolloutLimitReachedError


def test_version_is_the_pyproject_version():
    """``__version__`` is read from the installed distribution, whose one source is
    pyproject.toml: a stale install (or a second hand-written version) fails here."""
    from pathlib import Path

    import tomllib

    import agentloop_langgraph

    pyproject = Path(__file__).resolve().parents[1] / "pyproject.toml"
    assert agentloop_langgraph.__version__ == tomllib.loads(pyproject.read_text())["project"]["version"]
