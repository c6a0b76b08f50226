"""SGLangServer against a stand-in honouring the sglang.Engine surface it calls.

The stand-in (``agentloop_engines.testing.StandInSGLangEngine``) enforces what the real
engine enforces: ``async_generate`` only on ``engine.loop``, control methods synchronous via
``engine.loop.run_until_complete`` (so they fail if called while the loop runs), unique live
rids, ``abort_request`` on the tokenizer manager. It also misbehaves the way SGLang does (checked on a real SGLang build, see the stand-in's docstring),
so each test below fails on an adapter that trusts SGLang on that point. The same checks run
against a real ``sglang.Engine`` in the gpu-marked ``test_sglang_real_engine.py``.
"""

from __future__ import annotations

import asyncio
import importlib.util
import logging
from types import SimpleNamespace

import pytest

from agentloop_core.protocol import CapabilityNotSupportedError, TokenOutput
from agentloop_engines.adapters.sglang.server import SGLangServer, _checkpoint_weight_names
from agentloop_engines.testing import DEFAULT_EOS_TOKEN_ID as EOS
from agentloop_engines.testing import DEFAULT_VOCAB_SIZE as VOCAB
from agentloop_engines.testing import StandInSGLangEngine, write_checkpoint


def expected(prompt_last: int, n: int, step: int = 1) -> list[int]:
    out, last = [], prompt_last
    for _ in range(n):
        last = (last + step) % VOCAB
        out.append(last)
    return out


def greedy(max_tokens: int, **extra) -> dict:
    return {"max_tokens": max_tokens, "temperature": 0, **extra}


@pytest.fixture
def engine():
    eng = StandInSGLangEngine()
    yield eng
    eng.loop.close()


@pytest.fixture
async def server(engine):
    srv = SGLangServer(engine, eos_token_ids=[EOS])
    yield srv
    await srv.close()


async def in_thread_server(**engine_kwargs) -> tuple[StandInSGLangEngine, SGLangServer]:
    # Built in a worker thread, so it gets its own loop as sglang.Engine does outside asyncio.
    engine = await asyncio.to_thread(StandInSGLangEngine, **engine_kwargs)
    return engine, SGLangServer(engine, eos_token_ids=[EOS])


async def close(engine: StandInSGLangEngine, server: SGLangServer) -> None:
    await server.close()
    engine.loop.close()


def test_stand_in_misbehaves_like_sglang():
    """Guards the stand-in itself: the adapter tests below prove nothing if it stops misbehaving."""
    eng = StandInSGLangEngine(finish_lag_s=60)
    params = {"max_new_tokens": 10, "temperature": 0, "stop_token_ids": [23], "ignore_eos": True}
    out = eng.loop.run_until_complete(eng.async_generate([20], params, return_logprob=True, rid="r"))
    assert len(out["output_ids"]) == 10  # (a) the stop token did not stop it
    assert eng.flush_cache() is False
    assert eng.running == 1
    with pytest.raises(AssertionError):
        eng.update_weights_from_tensor([("step", 2)])
    with pytest.raises(RuntimeError, match="died"):
        eng.flush_cache()
    eng.loop.close()
    eng = StandInSGLangEngine()
    params = {**params, "max_new_tokens": 2, "ignore_eos": False}
    out = eng.loop.run_until_complete(eng.async_generate([5] * 57, params, return_logprob=True, rid="long"))
    assert len(out["output_ids"]) == 2  # (d) max_req_input_len - 1 tokens: served
    for n in (58, 59):  # (d) max_req_input_len tokens or more: SGLang's own error (>=, not >)
        with pytest.raises(ValueError, match=rf"^Input length \({n} tokens\) exceeds the maximum allowed "
                                             r"length \(58 tokens\)\. Use a shorter input"):
            eng.loop.run_until_complete(eng.async_generate([5] * n, params, return_logprob=True, rid=f"l{n}"))
    assert eng.model_dtype == "float16"  # (g) "auto" runs the float32 checkpoint in float16
    eng.loop.run_until_complete(asyncio.sleep(0.05))  # (b) the served request stops counting as running
    eng.update_weights_from_tensor([("stepp", 5)], flush_cache=False)
    assert eng.step == 1  # (f) skipped silently
    assert [u.skipped for u in eng.weight_updates] == [("stepp",)]
    eng.release_memory_occupation()
    with pytest.raises(RuntimeError, match="released"):  # (b) writing released weights kills it
        eng.update_weights_from_tensor([("step", 2)], flush_cache=False)
    assert eng.dead
    eng.loop.close()


def test_stand_in_built_from_a_model_path_reads_the_checkpoint(tmp_path, monkeypatch):
    """Behind ``SGLangServer(model_path=...)`` the stand-in takes the Engine kwargs the adapter
    passes, and its vocabulary, EOS, context length and weight names come from the checkpoint
    folder; a misspelt name is skipped silently by it (as by SGLang) and caught by the adapter.
    If this fails, the stand-in no longer accepts what ``sglang.Engine`` gets from the adapter."""
    path = write_checkpoint(tmp_path / "ckpt", names=("model.embed_tokens.weight", "model.norm.weight"),
                            vocab_size=50, eos_token_id=7, max_position_embeddings=128)
    built: list[StandInSGLangEngine] = []

    def engine(**kwargs):
        built.append(StandInSGLangEngine(**kwargs))
        return built[-1]

    monkeypatch.setattr("agentloop_engines.adapters.sglang.server._require_sglang", lambda: SimpleNamespace(Engine=engine))
    server = SGLangServer(model_path=str(path), enable_memory_saver=True, random_seed=3, tp_size=1,
                          mem_fraction_static=0.4, dtype="bfloat16")
    (eng,) = built
    args = eng.server_args
    assert (args.model_path, args.random_seed, args.mem_fraction_static, args.dtype) == (str(path), 3, 0.4, "bfloat16")
    assert (server.vocab_size, server.context_len, server.capabilities.sleep) == (50, 128, True)
    assert server.weight_names == {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}

    async def run():
        out = await server.generate("e", [3], greedy(20))
        assert out.token_ids == [4, 5, 6, 7]
        assert out.stop_reason == "stop"
        with pytest.raises(ValueError, match="did you mean 'model.norm.weight'"):
            await server.update_weights([("model.norm.weigth", 0)])
        await server.update_weights([("model.norm.weight", 0), ("lm_head.weight", 0)])
        await server.close()

    asyncio.run(run())
    assert [u.skipped for u in eng.weight_updates] == [("lm_head.weight",)]
    assert eng.shut_down
    assert eng.loop.is_closed()
    direct = StandInSGLangEngine(str(path))
    direct.update_weights_from_tensor([("model.norm.weigth", 0)])
    assert direct.weight_updates[0].skipped == ("model.norm.weigth",)
    assert direct.dead is None
    direct.shutdown()
    with pytest.raises(FileNotFoundError, match="downloads nothing"):
        StandInSGLangEngine(model_path="some-org/some-model")


def test_a_float32_checkpoint_runs_in_float32_unless_a_dtype_is_given(tmp_path, monkeypatch):
    """(g) SGLang's dtype="auto" runs a float32 checkpoint in float16 (the resumed log-probs of a
    real partial rollout were then 0.126 nats off HF's). SGLangServer(model_path=...) without a
    dtype passes "float32" for a float32 checkpoint, nothing for a 16-bit one (auto keeps its
    dtype), and a given dtype unchanged. Fails if the adapter leaves a float32 checkpoint to
    SGLang's "auto" (the stand-in then reports model_dtype float16)."""
    from agentloop_engines.adapters.dtypes import checkpoint_dtype, default_engine_dtype

    built: list[StandInSGLangEngine] = []

    def engine(**kwargs):
        built.append(StandInSGLangEngine(**kwargs))
        return built[-1]

    monkeypatch.setattr("agentloop_engines.adapters.sglang.server._require_sglang", lambda: SimpleNamespace(Engine=engine))
    fp32 = write_checkpoint(tmp_path / "fp32")
    bf16 = write_checkpoint(tmp_path / "bf16", dtype="bfloat16")
    undeclared = write_checkpoint(tmp_path / "none", dtype=None)
    cases = [(fp32, {}, "float32", "float32"), (fp32, {"dtype": None}, "float32", "float32"),
             (undeclared, {}, "float32", "float32"), (bf16, {}, "auto", "bfloat16"),
             (fp32, {"dtype": "bfloat16"}, "bfloat16", "bfloat16"), (fp32, {"dtype": "auto"}, "auto", "float16")]
    for path, kwargs, sent, runs in cases:
        server = SGLangServer(model_path=str(path), eos_token_ids=[EOS], **kwargs)
        assert (built[-1].server_args.dtype, built[-1].model_dtype) == (sent, runs), (path.name, kwargs)
        asyncio.run(server.close())
    assert [checkpoint_dtype(p) for p in (fp32, bf16, undeclared)] == ["float32", "bfloat16", "float32"]
    assert default_engine_dtype(bf16) is None
    assert checkpoint_dtype(tmp_path / "missing") is None
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "config.json").write_text('{"torch_dtype": "float16"}')  # transformers 4 spelling
    assert checkpoint_dtype(tmp_path / "old") == "float16"


async def test_generate_returns_engine_tokens_and_logprobs(server, engine):
    out = await server.generate("a", [10, 11], greedy(5, top_k=0))
    assert out.token_ids == expected(11, 5)
    assert out.log_probs == [-0.01 * (t % 7) for t in out.token_ids]
    assert out.stop_reason == "length"
    call = engine.calls[-1]
    assert call["top_k"] == -1
    assert call["max_new_tokens"] == 5
    assert call["ignore_eos"] is False
    assert call["rid"].startswith("a#")


async def test_stop_token_and_eos_end_generation_included(server):
    out = await server.generate("s", [20], greedy(50, stop_token_ids=[23]))
    assert out.token_ids == [21, 22, 23]
    assert out.stop_reason == "stop"
    eos = await server.generate("e", [0], greedy(50))
    assert eos.token_ids == [1, EOS]
    assert eos.stop_reason == "stop"
    nolp = await server.generate("n", [5], greedy(2, logprobs=False))
    assert nolp.log_probs is None
    assert nolp.token_ids == [6, 7]


async def test_ignore_eos_ignores_eos_only_and_still_honours_stop_token_ids(server, engine):
    """(a) SGLang's ignore_eos drops every stop token; the adapter cuts at the requested one."""
    out = await server.generate("i", [0], greedy(50, ignore_eos=True, stop_token_ids=[5]))
    assert out.token_ids == [1, EOS, 3, 4, 5]
    assert out.stop_reason == "stop"
    assert out.log_probs == [-0.01 * (t % 7) for t in out.token_ids]
    assert engine.calls[-1]["ignore_eos"] is True
    free = await server.generate("f", [0], greedy(20, ignore_eos=True))
    assert free.token_ids == expected(0, 20)
    assert free.stop_reason == "length"


async def test_update_right_after_generate_waits_until_sglang_is_idle():
    """(b) SGLang counts a returned request as running for one more pass; updating (or sleeping)
    then kills it. The adapter flushes with retries first, then updates with flush_cache=False."""
    engine, server = await in_thread_server(finish_lag_s=0.3)
    try:
        before = await server.generate("w", [10], greedy(4))
        await server.update_weights([("step", 3)])
        assert engine.dead is None
        assert engine.flushes == 1
        after = await server.generate("w", [10], greedy(4))
        assert after.token_ids == expected(10, 4, step=3) != before.token_ids
    finally:
        await close(engine, server)


async def test_update_and_sleep_wait_for_running_requests():
    """(b) A request in flight finishes untouched before sleep/update; requests sent meanwhile
    wait and then run on the new state."""
    engine, server = await in_thread_server(step_delay_s=0.005, enable_memory_saver=True)
    try:
        running = asyncio.create_task(server.generate("r", [3], greedy(30)))
        await asyncio.sleep(0.02)
        sleeping = asyncio.create_task(server.sleep())
        await asyncio.sleep(0.02)
        waiting = asyncio.create_task(server.generate("later", [3], greedy(3)))
        out = await running
        assert out.token_ids == expected(3, 30)
        assert out.stop_reason == "length"
        await sleeping
        assert engine.released
        assert engine.memory_freed
        assert not waiting.done()
        await server.wake_up()
        assert (await waiting).token_ids == expected(3, 3)
        running = asyncio.create_task(server.generate("r2", [3], greedy(30)))
        await asyncio.sleep(0.02)
        await server.update_weights([("step", 2)])
        assert (await running).token_ids == expected(3, 30)
        assert engine.dead is None
        assert (await server.generate("r3", [3], greedy(3))).token_ids == expected(3, 3, step=2)
    finally:
        await close(engine, server)


async def test_update_gives_up_with_a_clear_error_while_sglang_stays_busy(engine):
    """(b) Another client's request keeps the scheduler busy: a bounded wait, then an error and
    no update (an update then would kill the engine)."""
    server = SGLangServer(engine, eos_token_ids=[EOS], flush_timeout_s=0.05)
    engine.running = 1
    with pytest.raises(RuntimeError, match="flush_cache kept failing"):
        await server.update_weights([("step", 5)])
    assert engine.step == 1
    assert engine.dead is None
    engine.running = 0
    await server.update_weights([("step", 5)])
    assert engine.step == 5
    await server.close()


async def test_seeds_are_not_promised_without_deterministic_inference(server, engine, caplog):
    """(c) SGLang ignores sampling_seed unless deterministic inference is on: the server says so
    (per_request_seed), accepts seeded requests as the conformance suite sends them, and warns."""
    with caplog.at_level(logging.WARNING, logger="agentloop_engines.adapters.sglang.server"):
        a, b = [await server.generate("s", [10], {"max_tokens": 40, "temperature": 1.0, "seed": 7})
                for _ in range(2)]
    assert a.token_ids != b.token_ids  # 2**-40 to collide
    assert "sampling_seed" not in engine.calls[-1]
    assert sum("enable_deterministic_inference" in r.message for r in caplog.records) == 1
    assert server.per_request_seed is False

    det, det_server = await in_thread_server(enable_deterministic_inference=True)
    try:
        assert det_server.per_request_seed is True
        a, b = [await det_server.generate("s", [10], {"max_tokens": 40, "temperature": 1.0, "seed": 7})
                for _ in range(2)]
        assert a.token_ids == b.token_ids
        assert det.calls[-1]["sampling_seed"] == 7
    finally:
        await close(det, det_server)


async def test_prompt_and_budget_follow_sglang_limits(server, engine):
    """(d) Prompts of up to max_req_input_len - 1 tokens are served with max_tokens clamped to
    what SGLang serves (context - prompt - 2); one of exactly max_req_input_len tokens (SGLang
    refuses >=) is the adapter's own ValueError, naming the limit and the fix, and never reaches
    SGLang. Fails on an adapter that compares with > (the stand-in then raises SGLang's error)."""
    assert (server.context_len, server.max_req_input_len, server.max_prompt_len, server.max_model_len) == \
        (64, 58, 57, 62)
    longest = await server.generate("l", list(range(3, 60)), greedy(50, ignore_eos=True))  # 57 tokens
    assert longest.token_ids == expected(59, 5)
    assert longest.stop_reason == "length"
    assert engine.calls[-1]["max_new_tokens"] == 5  # the budget the adapter sent is what SGLang serves
    sent = len(engine.calls)
    for n in (58, 59):
        with pytest.raises(ValueError, match=rf"prompt has {n} tokens but SGLang refuses prompts of "
                                             r"max_req_input_len=58 tokens or more .*at most 57 tokens.*"
                                             r"actor_rollout_ref\.rollout\.max_model_len"):
            await server.generate("x", list(range(3, 3 + n)), greedy(2))
    assert len(engine.calls) == sent  # refused before SGLang saw it
    other = await asyncio.to_thread(StandInSGLangEngine)
    narrow = SGLangServer(other, eos_token_ids=[EOS], max_req_input_len=10, context_len=40)
    try:
        assert (narrow.max_prompt_len, narrow.max_model_len) == (9, 14)  # max_req_len = 10 + 5
        with pytest.raises(ValueError, match="max_req_input_len=10 tokens or more"):
            await narrow.generate("x", list(range(3, 13)), greedy(2))
        out = await narrow.generate("y", list(range(3, 12)), greedy(50, ignore_eos=True))
        assert len(out.token_ids) == 5
    finally:
        await close(other, narrow)


async def test_a_kv_pool_smaller_than_the_context_lowers_both_limits():
    """(d) SGLang's max_req_len is min(context, KV pool) - 1: with a pool of 32 tokens under a
    context of 64, prompts stop at 25 tokens and prompt + new tokens at 30, and the adapter's
    budget follows (max_model_len = max_req_input_len + 4, not context - 2)."""
    engine, server = await in_thread_server(max_total_tokens=32)
    try:
        assert (server.max_req_input_len, server.max_prompt_len, server.max_model_len) == (26, 25, 30)
        out = await server.generate("p", list(range(3, 28)), greedy(50, ignore_eos=True))  # 25 tokens
        assert out.token_ids == expected(27, 5)
        assert engine.calls[-1]["max_new_tokens"] == 5
        with pytest.raises(ValueError, match="max_req_input_len=26"):
            await server.generate("q", list(range(3, 29)), greedy(2))
    finally:
        await close(engine, server)


async def test_sleep_is_declared_only_with_the_memory_saver(server, engine):
    """(e) Without SGLang's memory saver sleep frees nothing, so it is not declared."""
    assert server.capabilities.sleep is False
    assert server.capabilities.weight_update
    with pytest.raises(CapabilityNotSupportedError, match="enable_memory_saver=True"):
        await server.sleep()
    assert not engine.released
    with pytest.raises(ValueError, match="enable_memory_saver"):
        SGLangServer(engine, enable_memory_saver=True)


async def test_sleep_releases_and_wake_up_restores():
    engine, server = await in_thread_server(enable_memory_saver=True)
    try:
        assert server.capabilities.sleep is True
        await server.sleep()
        await server.sleep()  # idempotent
        assert engine.released
        assert engine.memory_freed
        assert engine.dead is None
        with pytest.raises(RuntimeError, match="wake_up"):
            await server.update_weights([("step", 2)])
        held = asyncio.create_task(server.generate("held", [5], greedy(2)))
        await asyncio.sleep(0.01)
        await server.abort("held")  # held back while asleep: returns at once, never reaches SGLang
        out = await asyncio.wait_for(held, 5)
        assert (out.token_ids, out.log_probs, out.stop_reason) == ([], [], "aborted")
        assert not any(c["rid"].startswith("held#") for c in engine.calls)
        await server.wake_up()
        assert (await server.generate("z", [5], greedy(2))).token_ids == [6, 7]
    finally:
        await close(engine, server)


async def test_unknown_weight_names_are_rejected(server, engine):
    """(f) SGLang skips unknown names silently; the adapter checks them against the checkpoint."""
    with pytest.raises(ValueError, match=r"'stepp' \(did you mean 'step'\?\)"):
        await server.update_weights([("stepp", 3)])
    with pytest.raises(ValueError, match="'module.step'"):
        await server.update_weights([("step", 3), ("module.step", 3)])
    assert engine.step == 1
    await server.update_weights([("step", 3), ("lm_head.weight", 0)])  # tied: SGLang skips it on purpose
    assert engine.step == 3
    assert server.weight_names == {"step", "model.embed_tokens.weight", "lm_head.weight"}


def test_checkpoint_weight_names(tmp_path, caplog):
    sharded = write_checkpoint(tmp_path / "sharded", names=("a.weight", "b.weight"), tied=False, index=True)
    (sharded / "model.safetensors").unlink()  # the index alone names the weights
    assert _checkpoint_weight_names(str(sharded)) == {"a.weight", "b.weight"}
    assert _checkpoint_weight_names(str(tmp_path / "missing")) is None
    pointer = write_checkpoint(tmp_path / "lfs")
    (pointer / "model.safetensors").write_text("version https://git-lfs.github.com/spec/v1\noid sha256:00\n")
    assert _checkpoint_weight_names(str(pointer)) is None
    engine = StandInSGLangEngine()
    engine.server_args.model_path = str(tmp_path / "missing")
    with caplog.at_level(logging.WARNING, logger="agentloop_engines.adapters.sglang.server"):
        unchecked = SGLangServer(engine, eos_token_ids=[EOS])
    assert unchecked.weight_names is None
    assert "cannot read the checkpoint" in caplog.text
    unchecked._loop_thread.close()
    given = SGLangServer(engine, eos_token_ids=[EOS], weight_names=["step"])
    assert given.weight_names == {"step"}
    given._loop_thread.close()
    engine.loop.close()


async def test_concurrent_requests_all_run_on_the_engine_loop(server):
    outs = await asyncio.gather(*(server.generate("same-trajectory", [i + 3], greedy(3)) for i in range(8)))
    assert [o.token_ids for o in outs] == [expected(i + 3, 3) for i in range(8)]


async def test_abort_stops_an_in_flight_request():
    engine, server = await in_thread_server(context_length=10_000, step_delay_s=0.005)
    try:
        task = asyncio.create_task(server.generate("long", [3], greedy(5000, ignore_eos=True)))
        await asyncio.sleep(0.1)
        await server.abort("long")
        out = await asyncio.wait_for(task, 5)
        assert out.stop_reason == "aborted"
        assert 0 < len(out.token_ids) < 5000
        assert out.token_ids == expected(3, len(out.token_ids))
    finally:
        await close(engine, server)


async def test_update_weights_changes_output_flushes_cache_and_restores(server, engine):
    before = await server.generate("w", [10], greedy(4))
    await server.update_weights([("step", 3)])
    after = await server.generate("w", [10], greedy(4))
    assert after.token_ids == expected(10, 4, step=3) != before.token_ids
    assert engine.flushes == 1
    await server.update_weights([("step", 1)])
    assert (await server.generate("w", [10], greedy(4))).token_ids == before.token_ids
    with pytest.raises(RuntimeError, match="step must be positive"):
        await server.update_weights([("step", 0)])
    assert engine.dead is None


async def test_engine_created_inside_a_running_loop_is_rejected():
    engine = StandInSGLangEngine()  # takes the test's running loop, like sglang.Engine would
    with pytest.raises(RuntimeError, match="outside a running event loop"):
        SGLangServer(engine, eos_token_ids=[EOS])


def test_construction_errors():
    engine = StandInSGLangEngine()
    engine.tokenizer_manager = SimpleNamespace(context_len=64, model_config=SimpleNamespace(vocab_size=VOCAB))
    with pytest.raises(ValueError, match="pass them to SGLangServer"):  # no max_req_input_len
        SGLangServer(engine)
    with pytest.raises(ValueError, match="only used when engine is None"):
        SGLangServer(engine, mem_fraction_static=0.5)
    if importlib.util.find_spec("sglang") is None:
        with pytest.raises(ImportError, match=r'pip install "agentloop-engines\[sglang\]"'):
            SGLangServer(model_path="some/model")
    engine.loop.close()


def test_output_conversion_rejects_inconsistent_ids():
    from agentloop_core.protocol import SamplingParams

    bad = {"output_ids": [1, 2], "meta_info": {"output_token_logprobs": [(-0.1, 1, None), (-0.2, 3, None)],
                                               "finish_reason": {"type": "length"}}}
    with pytest.raises(RuntimeError, match="refusing to guess"):
        SGLangServer._to_token_output(bad, SamplingParams())
    ok = SGLangServer._to_token_output({**bad, "output_ids": [1, 3]}, SamplingParams())
    assert ok == TokenOutput([1, 3], [-0.1, -0.2], "length", extra=ok.extra)
