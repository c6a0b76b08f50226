"""From config to engine and loops: engine specs, remote servers' key, verl's loop YAML."""

from __future__ import annotations

import asyncio
import contextlib
import textwrap

import pytest

from agentloop_trainer.config import ConfigError, load_config
from agentloop_trainer.rollout import agent_loops, build_engine, remote_engines
from agentloop_trainer.stages.rollout_setup import engine_config, rollout_config


def test_engine_config_carries_the_common_and_per_engine_keys():
    cfg = load_config(["actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.dtype=bfloat16",
                       "actor_rollout_ref.rollout.gpu_memory_utilization=0.7",
                       "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
                       "+actor_rollout_ref.rollout.engine_kwargs.vllm.enable_prefix_caching=true",
                       "+actor_rollout_ref.rollout.engine_kwargs.sglang.ignored_here=1",
                       "data.max_prompt_length=100", "data.max_response_length=28"])
    spec = engine_config(cfg, "/m")
    assert (spec.name, spec.dtype, spec.gpu_memory_utilization, spec.tensor_model_parallel_size) == \
        ("vllm", "bfloat16", 0.7, 2)
    assert spec.engine_kwargs == {"enable_prefix_caching": True}  # only the chosen engine's section
    assert spec.max_model_len == 128  # sized to what a trajectory needs


def test_verls_enable_prefix_caching_reaches_every_engine_under_its_own_name(random_model_path):
    """On by default, as in verl; false reaches vLLM as its argument, SGLang inverted as
    ``disable_radix_cache`` and HFServer as no cache at all."""
    from agentloop_engines.adapters.vllm import server as vllm_server

    assert load_config([]).actor_rollout_ref.rollout.enable_prefix_caching is True
    for value in (True, False):
        cfg = load_config(["actor_rollout_ref.rollout.name=vllm",
                           f"actor_rollout_ref.rollout.enable_prefix_caching={str(value).lower()}"])
        spec = engine_config(cfg, "/m")
        assert spec.enable_prefix_caching is value
        assert spec.arguments(vllm_server.CONFIG_ARGUMENTS)["enable_prefix_caching"] is value
    cfg = load_config([f"actor_rollout_ref.model.path={random_model_path}",
                       "actor_rollout_ref.rollout.enable_prefix_caching=false"])
    server = build_engine(engine_config(cfg, str(random_model_path)))
    try:
        assert server.prefix_cache is None
    finally:
        asyncio.run(server.close())


@pytest.mark.parametrize("name", ["hf", "vllm", "sglang"])
def test_the_rollout_engine_runs_in_float32_unless_rollout_dtype_says_otherwise(name):
    """The trainer computes log-probs against float32 weights (model.dtype=float32, or the
    float32 master weights of bfloat16 mixed precision), so every engine gets dtype=float32
    unless rollout.dtype is set, and never the engine's own "auto" (vLLM and SGLang run a
    float32 checkpoint in float16 under it). A one-line notice says when the engine's dtype
    differs from model.dtype; engine_kwargs.<name>.dtype still wins."""
    def spec_of(*overrides):
        lines: list[str] = []
        cfg = load_config([f"actor_rollout_ref.rollout.name={name}", *overrides])
        return engine_config(cfg, "/m", notice=lines.append), lines

    def engine_dtype(spec):  # what the engine's constructor receives
        from agentloop_engines.adapters.sglang import server as sglang_server
        from agentloop_engines.adapters.vllm import server as vllm_server

        names = {"vllm": vllm_server.CONFIG_ARGUMENTS, "sglang": sglang_server.CONFIG_ARGUMENTS}
        return spec.dtype if name == "hf" else spec.arguments(names[name])["dtype"]

    spec, lines = spec_of()
    assert (engine_dtype(spec), lines) == ("float32", [])
    spec, lines = spec_of("actor_rollout_ref.model.dtype=bfloat16")
    assert engine_dtype(spec) == "float32"
    assert len(lines) == 1
    assert "model.dtype=bfloat16" in lines[0]
    assert "rollout.dtype=bfloat16" in lines[0]
    spec, lines = spec_of("actor_rollout_ref.rollout.dtype=bfloat16")
    assert engine_dtype(spec) == "bfloat16"
    assert len(lines) == 1
    assert "rollout.dtype=bfloat16 but the trainer computes log-probs in" in lines[0]
    assert "model.dtype=float32" in lines[0]
    spec, lines = spec_of("actor_rollout_ref.rollout.dtype=bfloat16", "actor_rollout_ref.model.dtype=bfloat16")
    assert (engine_dtype(spec), lines) == ("bfloat16", [])
    spec, lines = spec_of("actor_rollout_ref.rollout.server_urls=[http://127.0.0.1:1]",
                          "actor_rollout_ref.rollout.dtype=float16")
    assert lines == []  # remote servers: the spec's dtype is not used
    if name == "hf":
        with pytest.raises(ConfigError, match="rollout.dtype must be float32, bfloat16, float16 or null "
                                              "with rollout.name=hf"):
            spec_of("actor_rollout_ref.rollout.dtype=auto")
    else:
        spec, lines = spec_of("actor_rollout_ref.rollout.dtype=auto")
        assert engine_dtype(spec) == "auto"
        assert len(lines) == 1
        spec, _ = spec_of(f"+actor_rollout_ref.rollout.engine_kwargs.{name}.dtype=float16")
        assert engine_dtype(spec) == "float16"
    with pytest.raises(ConfigError, match=r"rollout.dtype must be null \(float32\) or one of"):
        spec_of("actor_rollout_ref.rollout.dtype=fp16")


@pytest.mark.parametrize("native", [True, False])
def test_rollout_dtype_model_runs_the_engine_in_the_dtype_model_dtype_resolved_to(native, monkeypatch):
    """``rollout.dtype=model`` follows ``model.dtype`` as resolved for the device (auto: bfloat16
    where it is native, float32 elsewhere) without a notice, so one recipe gets a bfloat16 engine
    on a CPU with AVX512_BF16 and a float32 one on AVX2; an engine that cannot run both is
    refused when the config loads."""
    import dataclasses

    from agentloop_trainer.policy import precision
    from agentloop_trainer.rollout import settings

    monkeypatch.setattr(precision, "cpu_has_native_bf16", lambda: native)
    lines: list[str] = []
    cfg = load_config(["model.dtype=auto", "actor_rollout_ref.rollout.dtype=model"], notice=lines.append)
    spec = engine_config(cfg, "/m", notice=lines.append)
    expected = "bfloat16" if native else "float32"
    assert (cfg.model.dtype, spec.dtype) == (expected, expected)
    assert [line for line in lines if "rollout" in line] == []
    for given in ("float32", "bfloat16"):
        spec = engine_config(load_config([f"model.dtype={given}", "actor_rollout_ref.rollout.dtype=model"]), "/m",
                             notice=lines.append)
        assert spec.dtype == given
    assert [line for line in lines if "rollout" in line] == []

    real = settings.engine_plugin

    def float32_only(rollout):
        plugin = real(rollout)
        caps = dataclasses.replace(plugin.capabilities, dtypes=("float32",))
        return dataclasses.replace(plugin, capabilities=caps)

    monkeypatch.setattr(settings, "engine_plugin", float32_only)
    with pytest.raises(ConfigError, match="rollout.dtype must be float32 or null with rollout.name=hf"):
        load_config(["actor_rollout_ref.rollout.dtype=model"])


def test_the_hf_engine_gets_the_rollout_dtype(random_model_path):
    """build_engine hands the resolved dtype to HFServer, which casts the in-memory policy copy."""
    import asyncio

    import torch
    from transformers import AutoModelForCausalLM

    for overrides, expected in (([], torch.float32), (["actor_rollout_ref.rollout.dtype=bfloat16"], torch.bfloat16)):
        spec = engine_config(load_config(overrides), str(random_model_path), notice=lambda line: None)
        model = AutoModelForCausalLM.from_pretrained(random_model_path, dtype=torch.float32)
        server = build_engine(spec, model=model)
        try:
            assert server.model.dtype == expected
        finally:
            asyncio.run(server.close())


def test_bad_engine_settings_are_named():
    with pytest.raises(ConfigError, match=r"rollout.name must be one of the installed engines \(unknown engine 'tgi'; "
                                          r"installed engines: hf, sglang, vllm\."):
        load_config(["actor_rollout_ref.rollout.name=tgi"])
    cfg = load_config(["+actor_rollout_ref.rollout.engine_kwargs.vlm.x=1"])
    with pytest.raises(ValueError, match=r"engine_kwargs has sections \['vlm'\]"):
        engine_config(cfg, "/m")
    with pytest.raises(ConfigError, match="server_urls must be unset with the ray backend"):
        load_config(["actor_rollout_ref.rollout.server_urls=[http://127.0.0.1:1]", "actor_rollout_ref.rollout.backend=ray"])


def test_a_missing_engine_names_the_extra(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_vllm(name, *args, **kwargs):
        if name == "vllm" or name.startswith("vllm."):
            raise ImportError("No module named 'vllm'", name="vllm")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_vllm)
    spec = engine_config(load_config(["actor_rollout_ref.rollout.name=vllm"]), "/m")
    with pytest.raises(ImportError, match=r'rollout.name=vllm: .*pip install "agentloop-engines\[vllm\]"'):
        build_engine(spec)


def test_remote_servers_key_comes_from_the_environment(monkeypatch):
    pytest.importorskip("httpx", reason='needs pip install "agentloop-engines[server]"')
    urls = "actor_rollout_ref.rollout.server_urls=[http://127.0.0.1:9]"
    monkeypatch.delenv("MY_ENGINE_KEY", raising=False)
    with pytest.raises(ValueError, match="server_api_key_env=MY_ENGINE_KEY but that environment variable is unset"):
        remote_engines(load_config([urls, "actor_rollout_ref.rollout.server_api_key_env=MY_ENGINE_KEY"])
                       .actor_rollout_ref.rollout)
    monkeypatch.delenv("MY_CONTROL_KEY", raising=False)
    control = load_config([urls, "actor_rollout_ref.rollout.server_control_key_env=MY_CONTROL_KEY",
                           "actor_rollout_ref.rollout.server_max_response_bytes=1000000"]).actor_rollout_ref.rollout
    with pytest.raises(ValueError, match="server_control_key_env=MY_CONTROL_KEY but that environment variable"):
        remote_engines(control)
    monkeypatch.setenv("MY_CONTROL_KEY", "the-control-key")
    made: list[dict] = []  # what each EngineHTTPClient is built with (nothing is reachable at port 9)
    monkeypatch.setattr("agentloop_engines.fleet.http_client.EngineHTTPClient", lambda url, **kw: made.append(kw))
    monkeypatch.setattr("agentloop_engines.fleet.client.LLMServerClient", lambda servers: servers)
    remote_engines(control)
    assert made == [{"api_key": None, "control_key": "the-control-key", "max_response_bytes": 1_000_000}]


def test_remote_servers_read_answers_within_the_configured_limit():
    """A hostile server's endless answer stops at rollout.server_max_response_bytes."""
    pytest.importorskip("httpx", reason='needs pip install "agentloop-engines[server]"')
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from agentloop_engines.fleet.http_errors import ResponseTooLargeError

    class Endless(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            with contextlib.suppress(OSError):
                self.wfile.write(b'{"status": "' + b"x" * 4_000_000 + b'"}')

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Endless)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        cfg = load_config([f"actor_rollout_ref.rollout.server_urls=[http://127.0.0.1:{server.server_address[1]}]",
                           "actor_rollout_ref.rollout.server_max_response_bytes=100000"])
        with pytest.raises(ResponseTooLargeError, match="limit of 100000 bytes"):
            remote_engines(cfg.actor_rollout_ref.rollout)  # the client reads each server's /health
    finally:
        server.shutdown()
        server.server_close()


def test_verl_agent_loop_yaml_and_loop_sections(tmp_path):
    path = tmp_path / "agent_loops.yaml"
    path.write_text(textwrap.dedent("""
        - name: my_agent
          _target_: my_pkg.loops.MyAgentLoop
        - name: react_agent
          recursion_limit: 12
    """))
    cfg = load_config([f"actor_rollout_ref.rollout.agent.agent_loop_config_path={path}",
                       "+actor_rollout_ref.rollout.agent.loops.react_agent.system_prompt=Be brief."])
    classes, sections = agent_loops(cfg.actor_rollout_ref.rollout.agent)
    assert classes == {"my_agent": "my_pkg.loops.MyAgentLoop"}
    assert sections == {"react_agent": {"recursion_limit": 12, "system_prompt": "Be brief."}}
    # The record registers the classes at start-up: one that does not import is named there.
    with pytest.raises(ValueError, match=r"agent_loop_classes\['my_agent'\]: cannot import module 'my_pkg.loops'"):
        rollout_config(cfg)
    path.write_text("my_agent: pkg.Loop\n")
    with pytest.raises(ValueError, match="expected a YAML list"):
        agent_loops(cfg.actor_rollout_ref.rollout.agent)


def test_settings_reach_the_loop_under_the_loops_names():
    cfg = load_config([
        "actor_rollout_ref.rollout.multi_turn.tool_parser=hermes", "actor_rollout_ref.rollout.multi_turn.max_user_turns=2",
        "actor_rollout_ref.rollout.multi_turn.max_parallel_calls=3",
        "actor_rollout_ref.rollout.multi_turn.tool_response_truncate_side=left", "reward.source=function",
        "actor_rollout_ref.rollout.multi_turn.max_tool_response_tokens=256",
        "actor_rollout_ref.rollout.multi_turn.max_tool_response_length=null",
        # tool_agent, not react_agent: the trainer's own test session does not install
        # agentloop-langgraph, and the default loop must be importable at start-up.
        "actor_rollout_ref.rollout.agent.default_agent_loop=tool_agent",
        "actor_rollout_ref.rollout.val_kwargs.do_sample=true", "actor_rollout_ref.rollout.val_kwargs.temperature=0.6",
    ])
    s = rollout_config(cfg)
    from agentloop_tools.loop_config import ToolAgentConfig

    loop = ToolAgentConfig.from_mapping(s.loop_mapping())
    assert (loop.tool_parser, loop.max_user_turns, loop.max_parallel_calls, loop.tool_response_truncate_side,
            loop.tool_reward) == ("hermes", 2, 3, "left", "none")
    assert (loop.max_tool_response_tokens, loop.max_tool_response_length) == (256, None)
    assert s.default_agent_loop == "tool_agent"
    default = dict(s.agent_loop_configs)["tool_agent"]  # the default loop's config, built at start-up
    assert isinstance(default, ToolAgentConfig)
    assert (default.tool_parser, default.max_parallel_calls, default.tool_reward) == ("hermes", 3, "none")
    assert (s.val_sampling_params.temperature, s.val_sampling_params.top_k, s.val_sampling_params.top_p) == (0.6, 0, 1.0)


@pytest.mark.parametrize("key", ["max_tool_response_tokens", "max_tool_response_length"])
def test_tool_response_limits_are_null_or_positive(key):
    with pytest.raises(ConfigError, match=rf"multi_turn\.{key} must be null or at least 1"):
        load_config([f"actor_rollout_ref.rollout.multi_turn.{key}=0"])
    cfg = load_config([f"actor_rollout_ref.rollout.multi_turn.{key}=null"])
    assert getattr(cfg.actor_rollout_ref.rollout.multi_turn, key) is None


def test_reasoning_keys_reach_the_loop():
    cfg = load_config([
        "actor_rollout_ref.rollout.multi_turn.reasoning_parser=qwen3",
        "actor_rollout_ref.rollout.multi_turn.tool_calls_in_reasoning=true",
        "actor_rollout_ref.rollout.agent.default_agent_loop=tool_agent",
    ])
    from agentloop_tools.loop_config import ToolAgentConfig

    default = dict(rollout_config(cfg).agent_loop_configs)["tool_agent"]
    assert isinstance(default, ToolAgentConfig)
    assert (default.reasoning_parser, default.tool_calls_in_reasoning) == ("qwen3", True)
    plain = dict(rollout_config(load_config(["actor_rollout_ref.rollout.agent.default_agent_loop=tool_agent"]))
                 .agent_loop_configs)["tool_agent"]
    assert (plain.reasoning_parser, plain.tool_calls_in_reasoning) == (None, False)


def test_the_worker_settings_reach_the_rollout_record():
    assert rollout_config(load_config([])).switch_interval_s == 0.002
    s = rollout_config(load_config(["actor_rollout_ref.rollout.agent.switch_interval_s=0.0002",
                                    "actor_rollout_ref.rollout.agent.hold_full_gc=false",
                                    "actor_rollout_ref.rollout.agent.turns_per_loop_iteration=8"]))
    assert (s.switch_interval_s, s.hold_full_gc, s.turns_per_loop_iteration) == (0.0002, False, 8)
    assert rollout_config(load_config(["actor_rollout_ref.rollout.agent.switch_interval_s=null"])).switch_interval_s is None
