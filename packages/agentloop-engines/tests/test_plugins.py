"""agentloop-engines' ``agentloop.engines`` entry points: each names a plug-in whose declared
server capabilities are its adapter class's, and whose factory maps the generic
:class:`EngineConfig` onto the adapter's constructor.

A failure in the first test means the installed metadata lacks the entry points (reinstall the
package: ``pip install -e packages/agentloop-engines``) or a record disagrees with its class.
"""

from __future__ import annotations

import asyncio
import sys
from types import SimpleNamespace

import pytest

from agentloop_core.engine_registry import EngineConfig, build_engine, engine_names, get_engine_plugin
from agentloop_engines.plugins import HF_ENGINE, SGLANG_ENGINE, VLLM_ENGINE


def test_the_three_engines_are_installed_plugins_declaring_their_adapters_flags():
    assert {"hf", "vllm", "sglang"} <= set(engine_names())
    for plugin in (HF_ENGINE, VLLM_ENGINE, SGLANG_ENGINE):
        assert get_engine_plugin(plugin.name) == plugin
    from agentloop_engines.adapters.sglang.server import SGLangServer
    from agentloop_engines.adapters.vllm.server import VLLMServer

    assert VLLMServer.capabilities is VLLM_ENGINE.capabilities.server
    assert SGLangServer.capabilities is SGLANG_ENGINE.capabilities.server
    assert VLLM_ENGINE.load_factory() == VLLMServer.from_engine_config
    assert SGLANG_ENGINE.load_factory() == SGLangServer.from_engine_config
    # What the trainer asks of them instead of their names:
    assert [p.capabilities.partial_rollout for p in (HF_ENGINE, VLLM_ENGINE, SGLANG_ENGINE)] == [True, True, False]
    assert [p.capabilities.policy_copy for p in (HF_ENGINE, VLLM_ENGINE, SGLANG_ENGINE)] == [True, False, False]
    assert [p.capabilities.reserves_kv_cache for p in (HF_ENGINE, VLLM_ENGINE, SGLANG_ENGINE)] == [False, True, True]
    assert ["auto" in p.capabilities.dtypes for p in (HF_ENGINE, VLLM_ENGINE, SGLANG_ENGINE)] == [False, True, True]


def test_listing_the_engines_imports_none_of_their_packages():
    import subprocess

    code = ("import sys; from agentloop_core.engine_registry import engine_names, get_engine_plugin; "
            "names = engine_names(); [get_engine_plugin(n) for n in names]; "
            "print(sorted(m for m in ('torch', 'vllm', 'sglang', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out


def test_the_hf_factory_maps_the_record_onto_hfserver(model_path):
    pytest.importorskip("torch", reason='needs pip install "agentloop-engines[hf]"')
    import torch

    from agentloop_engines.adapters.hf import HFServer

    assert HFServer.capabilities is HF_ENGINE.capabilities.server
    config = EngineConfig(name="hf", model_path=str(model_path), dtype="bfloat16", max_batch_size=4, max_model_len=48,
                          seed=1, engine_kwargs={"batch_wait_s": 0.0})
    server = build_engine(config)
    try:
        assert isinstance(server, HFServer)
        assert (server.model.dtype, server.max_batch_size, server.max_model_len, server.batch_wait_s) == (
            torch.bfloat16, 4, 48, 0.0)
    finally:
        asyncio.run(server.close())


def test_the_sglang_factory_maps_the_record_onto_sglangs_names(monkeypatch, tmp_path):
    from agentloop_engines.testing import StandInSGLangEngine, write_checkpoint

    path = write_checkpoint(tmp_path / "ckpt")
    built: list[StandInSGLangEngine] = []

    def engine(**kwargs):
        built.append(StandInSGLangEngine(**kwargs))
        return built[-1]

    monkeypatch.setattr("agentloop_engines.adapters.sglang.server._require_sglang", lambda: SimpleNamespace(Engine=engine))
    tokenizer = SimpleNamespace(eos_token_id=0)
    config = EngineConfig(name="sglang", model_path=str(path), seed=7, dtype="bfloat16", max_model_len=96,
                          gpu_memory_utilization=0.3, free_cache_engine=False, enable_prefix_caching=False,
                          engine_kwargs={"mem_fraction_static": 0.4})
    server = build_engine(config, tokenizer=tokenizer)
    try:
        args = built[0].server_args
        assert (args.random_seed, args.dtype, args.context_length, args.mem_fraction_static,
                args.enable_memory_saver, args.tp_size, args.disable_radix_cache) == (7, "bfloat16", 96, 0.4, False, 1,
                                                                                      True)
        assert server.capabilities.sleep is False  # narrowed per instance: no memory saver
    finally:
        asyncio.run(server.close())
