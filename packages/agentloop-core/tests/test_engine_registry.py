"""Engine plug-ins: found through ``agentloop.engines`` entry points of a real (temporary)
distribution, isolated when broken, built from one :class:`EngineConfig`."""

from __future__ import annotations

import pickle
import sys
import textwrap

import pytest

from agentloop_core import engine_registry
from agentloop_core.engine_registry import (
    EngineCapabilities,
    EngineConfig,
    EngineImportError,
    EnginePlugin,
    UnknownEngineError,
    build_engine,
    engine_factory,
    engine_names,
    get_engine_plugin,
    register_engine,
)
from agentloop_core.protocol import ServerCapabilities

MODULE = "agentloop_demo_engine_plugin"

PLUGIN_SOURCE = f'''
from agentloop_core.engine_registry import EngineCapabilities, EnginePlugin
from agentloop_core.protocol import ServerCapabilities
from agentloop_core.testing.scripted import ScriptedServer

BUILT = []

def build(config, *, model=None, tokenizer=None):
    server = ScriptedServer(max_model_len=config.max_model_len or 64)
    BUILT.append((config, model, tokenizer))
    return server

PLUGIN = EnginePlugin(name="demo_scripted", factory="{MODULE}:build", install="pip install demo-scripted",
                      capabilities=EngineCapabilities(server=ScriptedServer.capabilities, policy_copy=True))
COPYLESS = EnginePlugin(name="demo_copyless", factory="{MODULE}:build", install="pip install demo-scripted",
                        capabilities=EngineCapabilities(server=ServerCapabilities()))
MISSING = EnginePlugin(name="demo_missing", factory="agentloop_no_such_engine_pkg.server:build",
                       install='pip install "demo-engines[missing]"',
                       capabilities=EngineCapabilities(server=ServerCapabilities()))
NOT_A_PLUGIN = object()
'''

ENTRY_POINTS = f"""
[agentloop.engines]
demo_scripted = {MODULE}:PLUGIN
demo_copyless = {MODULE}:COPYLESS
demo_missing = {MODULE}:MISSING
demo_broken = agentloop_no_such_plugin_module:PLUGIN
demo_not_a_plugin = {MODULE}:NOT_A_PLUGIN
demo_misnamed = {MODULE}:PLUGIN
"""


@pytest.fixture
def demo_distribution(tmp_path, monkeypatch):
    """A distribution on sys.path declaring the entry points above; the registry's state and
    the imported module are restored afterwards."""
    (tmp_path / f"{MODULE}.py").write_text(textwrap.dedent(PLUGIN_SOURCE))
    info = tmp_path / "agentloop_demo_engines-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: agentloop-demo-engines\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(textwrap.dedent(ENTRY_POINTS))
    monkeypatch.syspath_prepend(str(tmp_path))
    registry, broken = dict(engine_registry._REGISTRY), dict(engine_registry._BROKEN)
    yield sys.modules.get(MODULE) or __import__(MODULE)
    engine_registry._REGISTRY.clear()
    engine_registry._REGISTRY.update(registry)
    engine_registry._BROKEN.clear()
    engine_registry._BROKEN.update(broken)
    sys.modules.pop(MODULE, None)


def test_an_entry_point_plugin_is_found_and_built_from_the_generic_record(demo_distribution):
    assert {"demo_scripted", "demo_copyless", "demo_missing"} <= set(engine_names())
    plugin = get_engine_plugin("demo_scripted")
    config = EngineConfig(name="demo_scripted", model_path="/m", max_model_len=32, engine_kwargs={"x": 1})
    server = build_engine(config, model="policy-copy", tokenizer="tok")
    assert server.max_model_len == 32
    assert [(config, "policy-copy", "tok")] == demo_distribution.BUILT
    assert plugin.capabilities.logprobs is True
    assert plugin.capabilities.sleep is False
    # A plug-in that does not take a policy copy never receives one; the folder goes as the tokenizer.
    build_engine(EngineConfig(name="demo_copyless", model_path="/m"), model="policy-copy")
    assert demo_distribution.BUILT[-1][1:] == (None, "/m")


def test_broken_entry_points_are_isolated_and_reported_by_name(demo_distribution):
    assert "demo_broken" not in engine_names()
    assert "demo_broken" in engine_names(include_broken=True)
    with pytest.raises(UnknownEngineError, match=r"'demo_broken' is installed but broken: .*ModuleNotFoundError"):
        get_engine_plugin("demo_broken")
    with pytest.raises(UnknownEngineError, match=r"is not an agentloop_core.engine_registry.EnginePlugin \(got object\)"):
        get_engine_plugin("demo_not_a_plugin")
    with pytest.raises(UnknownEngineError, match="holds the plug-in named 'demo_scripted'"):
        get_engine_plugin("demo_misnamed")
    assert get_engine_plugin("demo_scripted").name == "demo_scripted"  # the good ones still load


def test_an_unknown_name_lists_the_installed_engines_and_how_to_add_one(demo_distribution):
    with pytest.raises(UnknownEngineError) as info:
        get_engine_plugin("demo_scriptd")
    message = str(info.value)
    assert "did you mean 'demo_scripted'?" in message
    assert "demo_copyless" in message
    assert "installed but broken: demo_broken" in message
    assert "'agentloop.engines'" in message
    assert "register_engine" in message


def test_a_factory_that_fails_to_import_names_its_install_line(demo_distribution):
    with pytest.raises(EngineImportError, match=r"engine 'demo_missing' \(agentloop_no_such_engine_pkg.server:build\)"
                                                r".*install it with: pip install \"demo-engines\[missing\]\""):
        build_engine(EngineConfig(name="demo_missing", model_path="/m"))


def test_an_import_error_inside_the_factory_names_the_install_line_once():
    def needs_gpu_package(config, *, model=None, tokenizer=None):
        raise ImportError('MyServer needs gpulib: pip install "demo[gpu]"')

    module = type(sys)("agentloop_demo_inline_factory")
    module.build = needs_gpu_package
    sys.modules[module.__name__] = module
    try:
        plugin = EnginePlugin(name="inline", factory=f"{module.__name__}:build", install="pip install other",
                              capabilities=EngineCapabilities(server=ServerCapabilities()))
        with pytest.raises(EngineImportError) as info:
            build_engine(EngineConfig(name="inline", model_path="/m"), plugin=plugin)
    finally:
        del sys.modules[module.__name__]
    assert str(info.value).count("pip install") == 1
    assert 'pip install "demo[gpu]"' in str(info.value)


def test_engine_factory_pickles_with_its_plugin(demo_distribution):
    factory = engine_factory(EngineConfig(name="demo_scripted", model_path="/m", max_model_len=16))
    server = pickle.loads(pickle.dumps(factory))()
    assert server.max_model_len == 16


def test_engine_config_arguments_map_set_fields_and_engine_kwargs_win():
    config = EngineConfig(name="x", model_path="/m", seed=3, dtype=None, engine_kwargs={"tp": 4, "extra": True})
    assert config.arguments({"seed": "random_seed", "dtype": "dtype", "tensor_model_parallel_size": "tp"}) == {
        "random_seed": 3, "tp": 4, "extra": True}
    with pytest.raises(ValueError, match=r"EngineConfig has no fields \['sed'\]"):
        config.arguments({"sed": "seed"})


def test_register_engine_in_code_and_refuse_a_second_holder():
    caps = EngineCapabilities(server=ServerCapabilities(), partial_rollout=True)
    plugin = EnginePlugin(name="demo_in_code", factory="m:f", install="pip install m", capabilities=caps)
    try:
        assert register_engine(plugin) is plugin
        assert get_engine_plugin("demo_in_code") is plugin
        with pytest.raises(ValueError, match="already registered"):
            register_engine(EnginePlugin(name="demo_in_code", factory="m:g", install="-", capabilities=caps))
    finally:
        engine_registry._REGISTRY.pop("demo_in_code", None)
    with pytest.raises(ValueError, match="factory must be 'pkg.module:callable'"):
        EnginePlugin(name="bad", factory="m.f", install="-", capabilities=caps)
    assert caps.as_dict()["partial_rollout"] is True
    assert caps.as_dict()["logprobs"] is True
