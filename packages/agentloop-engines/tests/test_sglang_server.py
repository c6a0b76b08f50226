"""SGLangServer against a stand-in honouring the sglang.Engine surface it calls.

The stand-in enforces what the real engine enforces: ``async_generate`` only on ``engine.loop``,
control methods synchronous via ``engine.loop.run_until_complete`` (so they fail if called
while the loop runs), unique live rids, ``abort_request`` on the tokenizer manager. The same
checks run against a real ``sglang.Engine`` in the gpu-marked test.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
from types import SimpleNamespace

import pytest

from agentloop_core.protocol import TokenOutput
from agentloop_engines.sglang_server import SGLangServer

EOS = 2
VOCAB = 300
ALLOWED_KEYS = {"max_new_tokens", "temperature", "top_p", "top_k", "stop_token_ids", "ignore_eos",
                "sampling_seed"}


class StandInSGLangEngine:
    """Next token = (last + step) % VOCAB, step being the 'weight'; logprob -0.01 * (token % 7)."""

    def __init__(self, context_len: int = 64, step_delay_s: float = 0.0) -> None:
        try:
            self.loop = asyncio.get_running_loop()
        except RuntimeError:
            self.loop = asyncio.new_event_loop()
        self.step = 1
        self.step_delay_s = step_delay_s
        self.released = False
        self.flushes = 0
        self.calls: list[dict] = []
        self.live: dict[str, bool] = {}
        self.shut_down = False
        self.tokenizer_manager = SimpleNamespace(
            context_len=context_len, model_config=SimpleNamespace(vocab_size=VOCAB),
            abort_request=self._abort_request)

    def _abort_request(self, rid: str = "", abort_all: bool = False) -> None:
        assert asyncio.get_running_loop() is self.loop, "abort_request called off the engine loop"
        if rid in self.live:
            self.live[rid] = True

    async def async_generate(self, input_ids=None, sampling_params=None, return_logprob=False, rid=None):
        if asyncio.get_running_loop() is not self.loop:
            raise RuntimeError("async_generate awaited off engine.loop (the real engine hangs here)")
        if self.released:
            raise RuntimeError("memory released; resume_memory_occupation first")
        assert set(sampling_params) <= ALLOWED_KEYS, sampling_params
        assert rid not in self.live, f"duplicate live rid {rid}"
        self.calls.append({"rid": rid, "input_ids": list(input_ids), **sampling_params})
        self.live[rid] = False
        stops = set(sampling_params["stop_token_ids"])
        if not sampling_params["ignore_eos"]:
            stops.add(EOS)
        ids, last, reason = [], input_ids[-1], {"type": "length", "length": sampling_params["max_new_tokens"]}
        try:
            while len(ids) < sampling_params["max_new_tokens"]:
                if self.step_delay_s:
                    await asyncio.sleep(self.step_delay_s)
                if self.live[rid]:
                    reason = {"type": "abort", "message": "aborted"}
                    break
                last = (last + self.step) % VOCAB
                ids.append(last)
                if last in stops:
                    reason = {"type": "stop", "matched": last}
                    break
        finally:
            del self.live[rid]
        meta = {"id": rid, "finish_reason": reason}
        if return_logprob:
            meta["output_token_logprobs"] = [(-0.01 * (t % 7), t, None) for t in ids]
        return {"text": "", "output_ids": ids, "meta_info": meta}

    async def _bump(self, **changes):
        await asyncio.sleep(0)
        for k, v in changes.items():
            setattr(self, k, v)

    def update_weights_from_tensor(self, named_tensors, load_format=None, flush_cache=True):
        step = dict(named_tensors)["step"]
        self.loop.run_until_complete(self._bump(step=int(step)))
        return (True, "Success") if step > 0 else (False, "step must be positive")

    def flush_cache(self):
        self.loop.run_until_complete(self._bump(flushes=self.flushes + 1))

    def release_memory_occupation(self, tags=None):
        self.loop.run_until_complete(self._bump(released=True))

    def resume_memory_occupation(self, tags=None):
        self.loop.run_until_complete(self._bump(released=False))

    def shutdown(self):
        self.shut_down = True


def expected(prompt_last: int, n: int, step: int = 1) -> list[int]:
    out, last = [], prompt_last
    for _ in range(n):
        last = (last + step) % VOCAB
        out.append(last)
    return out


@pytest.fixture()
def engine():
    eng = StandInSGLangEngine()
    yield eng
    eng.loop.close()


@pytest.fixture()
async def server(engine):
    srv = SGLangServer(engine, eos_token_ids=[EOS])
    yield srv
    await srv.close()


async def test_generate_returns_engine_tokens_and_logprobs(server, engine):
    out = await server.generate("a", [10, 11], {"max_tokens": 5, "temperature": 0, "top_k": 0, "seed": 3})
    assert out.token_ids == expected(11, 5)
    assert out.log_probs == [-0.01 * (t % 7) for t in out.token_ids]
    assert out.stop_reason == "length"
    call = engine.calls[-1]
    assert call["top_k"] == -1 and call["sampling_seed"] == 3 and call["max_new_tokens"] == 5
    assert call["rid"].startswith("a#")


async def test_stop_token_is_included_and_max_tokens_clamped(server, engine):
    out = await server.generate("s", [20], {"max_tokens": 50, "stop_token_ids": [23]})
    assert out.token_ids == [21, 22, 23] and out.stop_reason == "stop"
    long = await server.generate("l", list(range(3, 63)), {"max_tokens": 50, "ignore_eos": True})
    assert len(long.token_ids) == 4  # 64-token context minus the 60-token prompt
    nolp = await server.generate("n", [5], {"max_tokens": 2, "logprobs": False})
    assert nolp.log_probs is None and nolp.token_ids == [6, 7]


async def test_concurrent_requests_all_run_on_the_engine_loop(server):
    outs = await asyncio.gather(*(server.generate("same-trajectory", [i + 3], {"max_tokens": 3})
                                  for i in range(8)))
    assert [o.token_ids for o in outs] == [expected(i + 3, 3) for i in range(8)]


async def test_abort_stops_an_in_flight_request():
    # Built in a worker thread, so it gets its own loop as sglang.Engine does outside asyncio.
    engine = await asyncio.to_thread(StandInSGLangEngine, context_len=10_000, step_delay_s=0.005)
    server = SGLangServer(engine, eos_token_ids=[EOS])
    try:
        task = asyncio.create_task(server.generate("long", [3], {"max_tokens": 5000, "ignore_eos": True}))
        await asyncio.sleep(0.1)
        await server.abort("long")
        out = await asyncio.wait_for(task, 5)
        assert out.stop_reason == "aborted"
        assert 0 < len(out.token_ids) < 5000
        assert out.token_ids == expected(3, len(out.token_ids))
    finally:
        await server.close()
        engine.loop.close()


async def test_update_weights_changes_output_flushes_cache_and_restores(server, engine):
    before = await server.generate("w", [10], {"max_tokens": 4})
    await server.update_weights([("step", 3)])
    after = await server.generate("w", [10], {"max_tokens": 4})
    assert after.token_ids == expected(10, 4, step=3) != before.token_ids
    assert engine.flushes == 1
    await server.update_weights([("step", 1)])
    assert (await server.generate("w", [10], {"max_tokens": 4})).token_ids == before.token_ids
    with pytest.raises(RuntimeError, match="step must be positive"):
        await server.update_weights([("step", 0)])


async def test_sleep_releases_and_wake_up_restores(server, engine):
    await server.sleep()
    assert engine.released
    with pytest.raises(RuntimeError, match="memory released"):
        await server.generate("z", [5], {"max_tokens": 2})
    await server.wake_up()
    assert (await server.generate("z", [5], {"max_tokens": 2})).token_ids == [6, 7]


async def test_engine_created_inside_a_running_loop_is_rejected():
    engine = StandInSGLangEngine()  # takes the test's running loop, like sglang.Engine would
    with pytest.raises(RuntimeError, match="outside a running event loop"):
        SGLangServer(engine, eos_token_ids=[EOS])


def test_construction_errors():
    engine = StandInSGLangEngine()
    engine.tokenizer_manager = SimpleNamespace()
    with pytest.raises(ValueError, match="pass them to SGLangServer"):
        SGLangServer(engine)
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


def _gpu_and_sglang() -> str | None:
    if importlib.util.find_spec("sglang") is None:
        return 'sglang is not installed (pip install "agentloop-engines[sglang]")'
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "no CUDA GPU"
    return None


@pytest.mark.gpu
@pytest.mark.skipif(_gpu_and_sglang() is not None, reason=str(_gpu_and_sglang()))
def test_real_sglang_engine_same_checks(tmp_path):
    """Same checks on a real sglang.Engine over the tiny model: greedy equals HF's greedy."""
    import sglang
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from agentloop_engines.tiny_model import build_tiny_model

    path = str(build_tiny_model())
    tok = AutoTokenizer.from_pretrained(path)
    engine = sglang.Engine(model_path=path, mem_fraction_static=float(os.environ.get("SGLANG_MEM", "0.3")),
                           disable_cuda_graph=True)

    async def run():
        server = SGLangServer(engine, tokenizer=tok)
        prompt = tok.encode("hello world", add_special_tokens=False)
        out = await server.generate("g", prompt, {"max_tokens": 8, "temperature": 0, "ignore_eos": True})
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        ref = model.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, min_new_tokens=8)
        assert out.token_ids == ref[0, len(prompt):].tolist()
        params = {name: p.detach().clone() * 0.5 for name, p in model.named_parameters()}
        await server.update_weights(params.items())
        changed = await server.generate("g2", prompt, {"max_tokens": 8, "temperature": 0, "ignore_eos": True})
        assert changed.token_ids != out.token_ids
        await server.update_weights({n: p for n, p in model.named_parameters()}.items())
        restored = await server.generate("g3", prompt, {"max_tokens": 8, "temperature": 0, "ignore_eos": True})
        assert restored.token_ids == out.token_ids
        await server.close()

    asyncio.run(run())
