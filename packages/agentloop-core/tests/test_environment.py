"""The environment registry: names in code, import paths, entry points (a broken plug-in is
reported under its name without hiding the others), and the default ``reset``."""

from __future__ import annotations

from importlib.metadata import EntryPoint

import pytest

from agentloop_core import environment as env_module
from agentloop_core import plugins
from agentloop_core.environment import (
    Environment,
    StepResult,
    UnknownEnvironmentError,
    environment_names,
    get_environment_class,
    register_environment,
)


@register_environment("core_test_done")
class DoneEnv(Environment):
    async def step(self, turn):
        return StepResult([], 1.0, True, {})


def test_names_in_code_and_by_import_path():
    assert get_environment_class("core_test_done") is DoneEnv
    assert DoneEnv.name == "core_test_done"
    assert "core_test_done" in environment_names()
    assert get_environment_class(f"{__name__}:DoneEnv") is DoneEnv


def test_a_name_taken_twice_or_a_non_environment_is_an_error():
    with pytest.raises(ValueError, match=r"already registered by .*DoneEnv"):
        register_environment("core_test_done")(type("Other", (DoneEnv,), {}))
    with pytest.raises(ValueError, match=r"is not an Environment subclass"):
        register_environment("core_test_junk")(int)  # type: ignore[arg-type]
    with pytest.raises(UnknownEnvironmentError, match=r"not an Environment subclass"):
        get_environment_class("builtins:int")


def test_entry_points_load_and_a_broken_one_is_named(monkeypatch):
    good = EntryPoint("core_test_ep", f"{__name__}:EntryEnv", env_module.ENTRY_POINT_GROUP)
    broken = EntryPoint("core_test_broken", "no_such_module_xyz:Env", env_module.ENTRY_POINT_GROUP)
    monkeypatch.setattr(plugins, "entry_points",
                        lambda group: [broken, good] if group == env_module.ENTRY_POINT_GROUP else [])
    assert get_environment_class("core_test_ep") is EntryEnv
    with pytest.raises(UnknownEnvironmentError, match=r"'core_test_broken' is installed but broken: .*ModuleNotFoundError"):
        get_environment_class("core_test_broken")
    with pytest.raises(UnknownEnvironmentError, match=r"unknown environment 'nope'; known environments: .*core_test_ep"):
        get_environment_class("nope")


class EntryEnv(Environment):
    async def step(self, turn):
        return [], 0.0, True, {}


async def test_default_reset_returns_the_rows_prompt():
    prompt = [{"role": "user", "content": "hi"}]
    assert await DoneEnv().reset({"raw_prompt": prompt}) == prompt
    with pytest.raises(ValueError, match=r"resets from the row's 'raw_prompt', which is empty"):
        await DoneEnv().reset({"raw_prompt": []})
