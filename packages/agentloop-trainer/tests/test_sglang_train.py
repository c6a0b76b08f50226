"""``agentloop train actor_rollout_ref.rollout.name=sglang`` end to end, with SGLang's CPU stand-in.

SGLang needs a GPU, so ``sglang.Engine`` is replaced by ``agentloop_engines.testing``'s
``StandInSGLangEngine``, which misbehaves the way SGLang does (it dies on a weight update or a
memory release while its scheduler is busy, skips unknown weight names silently, ...). The real
code path runs: ``engines.build_engine`` -> the ``sglang`` plug-in's ``SGLangServer.from_engine_config``
-> ``SGLangServer(model_path=...)`` -> ``Engine(...)``.

The stand-in's tokens do not come from the policy, so the trainer's log-prob check (and TIS)
only sees a large gap; that is expected here and is not what these tests check.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
from types import SimpleNamespace

import pytest

from agentloop_engines.testing import StandInSGLangEngine

RESPONSE_LENGTH = 40


def _overrides(tmp_path, model_path, *extra):
    return [
        f"model.path={model_path}", "trainer.total_steps=2", f"trainer.output_dir={tmp_path}",
        "trainer.experiment_name=sgl", "trainer.test_freq=0", "trainer.save_freq=0", "trainer.progress_bar=false",
        "data.train_size=64", "data.val_size=4", "data.train_batch_size=2",
        f"data.max_response_length={RESPONSE_LENGTH}", "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.rollout.multi_turn.max_tokens_per_turn=12", "actor_rollout_ref.rollout.name=sglang",
        *extra,
    ]


@pytest.fixture
def standins(monkeypatch):
    """Every ``sglang.Engine`` the run builds is a stand-in, collected here."""
    built: list[StandInSGLangEngine] = []

    def engine(**kwargs):
        built.append(StandInSGLangEngine(**kwargs))
        return built[-1]

    monkeypatch.setattr("agentloop_engines.adapters.sglang.server._require_sglang", lambda: SimpleNamespace(Engine=engine))
    return built


def test_agentloop_train_with_sglang_syncs_weights_into_an_idle_engine(tmp_path, random_model_path, standins):
    """`agentloop train ... rollout.name=sglang` runs 2 steps with no failed sample; after each
    update the engine slept (memory saver on, as free_cache_engine=true asks), woke up, and
    received the policy's full state dict while its scheduler was idle.

    A failure in ``main`` is the CLI/config/engine wiring (``engines.build_engine``) or the
    adapter; ``engine.dead`` set means the adapter released memory or updated weights while
    SGLang was busy (real SGLang asserts and its scheduler dies); names in ``skipped`` other
    than the tied ``lm_head.weight`` mean the trainer sent names SGLang would silently drop.
    """
    from transformers import AutoModelForCausalLM

    from agentloop_trainer.cli import main

    assert main(["train", *_overrides(tmp_path, random_model_path)]) == 0
    run_dir = tmp_path / "sgl"
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 2
    steps = [m for m in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "reward/mean" in m]
    assert [m["step"] for m in steps] == [1, 2]
    for m in steps:
        assert m["rollout/num_failed"] == 0, m
        assert m["rollout/generated_tokens"] > 0, m
        assert m["rollout/engine_slept"] == 1, m

    (engine,) = standins
    args = engine.server_args
    assert args.model_path == str(random_model_path)
    assert args.enable_memory_saver is True
    # float32 as the trainer computes log-probs, not SGLang's "auto" (which runs float32 weights in float16)
    assert (args.random_seed, args.tp_size, args.mem_fraction_static, args.dtype) == (0, 1, 0.5, "float32")
    assert engine.model_dtype == "float32"
    assert args.context_length == 512 + RESPONSE_LENGTH  # data.max_prompt_length + max_response_length
    assert engine.calls
    assert engine.dead is None
    assert engine.shut_down

    assert [e for e in engine.events if e != "flush_cache"] == [
        "release_memory_occupation", "resume_memory_occupation", "update_weights_from_tensor",
    ] * 2 + ["shutdown"]
    for i, event in enumerate(engine.events):
        if event in ("release_memory_occupation", "update_weights_from_tensor"):
            assert engine.events[i - 1] == "flush_cache", engine.events  # the adapter waited for idle

    policy = list(AutoModelForCausalLM.from_pretrained(random_model_path).state_dict())
    assert len(engine.weight_updates) == 2
    for update in engine.weight_updates:
        assert sorted(update.names) == sorted(policy)
        assert update.skipped == ("lm_head.weight",)  # tied to the embeddings: SGLang skips it on purpose
        assert update.running == 0
        assert update.flush_cache is False


def test_sglang_engine_arguments_without_free_cache_engine(random_model_path, tokenizer, standins):
    """free_cache_engine=false starts SGLang without the memory saver, so the adapter declares no
    sleep (the trainer then never releases memory); dtype and engine_kwargs.sglang reach
    ``sglang.Engine``. A failure names the argument ``engines.build_engine`` passes wrongly."""
    from agentloop_trainer.config import load_config
    from agentloop_trainer.rollout import build_engine
    from agentloop_trainer.stages.rollout_setup import engine_config

    cfg = load_config(_overrides("unused", random_model_path, "actor_rollout_ref.rollout.free_cache_engine=false",
                                 "actor_rollout_ref.rollout.dtype=bfloat16",
                                 "actor_rollout_ref.rollout.max_model_len=256",
                                 "actor_rollout_ref.rollout.engine_kwargs.sglang.disable_cuda_graph=true"))
    server = build_engine(engine_config(cfg, str(random_model_path)), tokenizer=tokenizer)
    try:
        (engine,) = standins
        args = engine.server_args
        assert (args.enable_memory_saver, args.dtype, args.context_length, args.disable_cuda_graph) == (
            False, "bfloat16", 256, True)
        assert engine.model_dtype == "bfloat16"
        assert server.capabilities.sleep is False
        assert server.capabilities.weight_update is True
        assert server.eos_token_ids == (tokenizer.eos_token_id,)
        assert "model.embed_tokens.weight" in server.weight_names
    finally:
        asyncio.run(server.close())


@pytest.mark.skipif(importlib.util.find_spec("sglang") is not None, reason="sglang is installed here")
def test_sglang_without_sglang_installed_names_the_extra(tmp_path, random_model_path):
    """Without SGLang the run stops with the pip line that installs it, not a bare ModuleNotFoundError."""
    from agentloop_trainer.cli import main

    with pytest.raises(ImportError, match=r'pip install "agentloop-engines\[sglang\]"'):
        main(["train", *_overrides(tmp_path, random_model_path)])
