"""HFServer on the tiny Qwen2 model: batching, exact log-probs, stops, abort, weights, sleep."""

from __future__ import annotations

import asyncio

import pytest

torch = pytest.importorskip("torch", reason='HFServer needs pip install "agentloop-engines[hf]"')
pytest.importorskip("transformers", reason='HFServer needs pip install "agentloop-engines[hf]"')

from agentloop_core.protocol import AsyncServer  # noqa: E402
from agentloop_engines.adapters.hf import HFServer  # noqa: E402

# model_path (conftest.py): the tiny model at a larger init than the training default, so random
# greedy outputs depend on the prompt and "same tokens" comparisons mean something.
# Generous: a wait this long means the engine hung, never that the machine was slow.
HANG_S = 120
PROMPTS = [[100, 200, 300], [5, 6, 7, 8, 9, 10, 11, 12, 13], [42], [400, 401, 402, 403, 404], [7, 70, 170, 270]]


@pytest.fixture(scope="module")
def server(model_path):
    return HFServer(model_path, max_batch_size=32)


def reference_log_probs(server: HFServer, prompt: list[int], generated: list[int], temperature: float) -> list[float]:
    """What a trainer computes: one plain forward pass over prompt + generated ids."""
    ids = torch.tensor([prompt + generated], device=server.device)
    with torch.no_grad():
        logits = server.model(input_ids=ids).logits[0].float()
    scaled = logits[len(prompt) - 1 : -1] / (temperature if temperature > 0 else 1.0)
    lp = torch.log_softmax(scaled, dim=-1)
    return lp.gather(1, torch.tensor(generated, device=lp.device)[:, None])[:, 0].tolist()


async def _decoding_row(server: HFServer, request_id: str):
    """The engine's row for ``request_id`` once it has generated its first token (engine
    internals: the caller sees tokens only when the request ends)."""
    while True:
        rows = [r for r in server._by_id.get(request_id, ()) if r.token_ids and not r.done]
        if rows:
            return rows[0]
        await asyncio.sleep(0.001)


async def test_sixteen_concurrent_requests_share_forward_passes(server):
    assert isinstance(server, AsyncServer)
    before = dict(server.stats)
    n_batches = len(server.batch_sizes)
    params = {"max_tokens": 8, "temperature": 0, "ignore_eos": True}
    outs = await asyncio.gather(*(server.generate(f"r{i}", [10 + i, 20, 30], params) for i in range(16)))
    assert all(len(o.token_ids) == 8 and o.stop_reason == "length" for o in outs)
    forward_calls = server.stats["forward_calls"] - before["forward_calls"]
    rows = server.stats["batched_rows"] - before["batched_rows"]
    assert forward_calls < 16 * 8 / 4, f"{forward_calls} forward calls for 16 x 8 tokens: not batched"
    assert rows == 16 * 8, "every row must be computed once per generated token"
    assert max(list(server.batch_sizes)[n_batches:]) > 1


async def test_greedy_is_deterministic_and_batching_does_not_change_it(server):
    params = {"max_tokens": 12, "temperature": 0, "ignore_eos": True}
    batched = await asyncio.gather(*(server.generate(f"b{i}", p, params) for i, p in enumerate(PROMPTS)))
    alone = [await server.generate(f"a{i}", p, params) for i, p in enumerate(PROMPTS)]
    again = await asyncio.gather(*(server.generate(f"c{i}", p, params) for i, p in enumerate(PROMPTS)))
    assert len({tuple(o.token_ids) for o in batched}) == len(PROMPTS), "outputs should depend on the prompt"
    for b, a, c in zip(batched, alone, again, strict=True):
        assert b.token_ids == a.token_ids == c.token_ids
        assert b.log_probs == pytest.approx(a.log_probs, abs=1e-4)


@pytest.mark.parametrize(("temperature", "extra"), [(1.0, {}), (0.7, {}), (0.0, {}), (0.8, {"top_k": 5, "top_p": 0.9})])
async def test_log_probs_match_a_forward_pass(server, temperature, extra):
    params = {"max_tokens": 16, "temperature": temperature, "ignore_eos": True, **extra}
    outs = await asyncio.gather(
        *(server.generate(f"lp{i}", p, {**params, "seed": i}) for i, p in enumerate(PROMPTS))
    )
    for prompt, out in zip(PROMPTS, outs, strict=True):
        ref = reference_log_probs(server, prompt, out.token_ids, temperature)
        assert max(abs(a - b) for a, b in zip(out.log_probs, ref, strict=True)) < 1e-4
    if "top_k" in extra:
        # Filtering changes what is drawn, never the reported (full-vocabulary) log-prob.
        prompt, out = PROMPTS[0], outs[0]
        ids = torch.tensor([prompt + out.token_ids])
        with torch.no_grad():
            logits = server.model(input_ids=ids).logits[0, len(prompt) - 1 : -1]
        top5 = logits.topk(5, dim=-1).indices.tolist()
        assert all(tok in allowed for tok, allowed in zip(out.token_ids, top5, strict=True))


async def test_logprobs_false_returns_none(server):
    # ignore_eos: an unseeded sample may draw EOS early, and this test is about log-probs, not length.
    params = {"max_tokens": 3, "logprobs": False, "ignore_eos": True}
    out = await server.generate("nolp", PROMPTS[0], params)
    assert out.log_probs is None
    assert len(out.token_ids) == 3
    assert out.stop_reason == "length"


async def test_seeded_sampling_is_reproducible_whatever_the_batch(server):
    params = {"max_tokens": 20, "temperature": 1.0, "ignore_eos": True}
    alone = await server.generate("s", PROMPTS[1], {**params, "seed": 123})
    crowd = await asyncio.gather(
        server.generate("s", PROMPTS[1], {**params, "seed": 123}),
        *(server.generate(f"x{i}", p, {**params, "seed": 9}) for i, p in enumerate(PROMPTS)),
    )
    other = await server.generate("s", PROMPTS[1], {**params, "seed": 124})
    assert crowd[0].token_ids == alone.token_ids
    assert other.token_ids != alone.token_ids


async def test_stop_token_ids_and_eos_end_generation_and_are_included(server):
    params = {"max_tokens": 12, "temperature": 0, "ignore_eos": True}
    free = await server.generate("f", PROMPTS[0], params)
    stop = free.token_ids[4]
    cut = free.token_ids.index(stop)
    out = await server.generate("f", PROMPTS[0], {**params, "stop_token_ids": [stop]})
    assert out.token_ids == free.token_ids[: cut + 1]
    assert out.stop_reason == "stop"
    assert out.log_probs == pytest.approx(free.log_probs[: cut + 1], abs=1e-5)

    saved = server.eos_token_ids
    server.eos_token_ids = (stop,)
    try:
        eos_out = await server.generate("f", PROMPTS[0], {"max_tokens": 12, "temperature": 0})
        ignored = await server.generate("f", PROMPTS[0], params)
    finally:
        server.eos_token_ids = saved
    assert eos_out.token_ids == free.token_ids[: cut + 1]
    assert eos_out.stop_reason == "stop"
    assert ignored.token_ids == free.token_ids
    assert ignored.stop_reason == "length"


async def test_max_tokens_is_respected_and_clamped_to_the_context(model_path):
    small = HFServer(model_path, max_model_len=24)
    assert small.max_model_len == 24
    params = {"temperature": 0, "ignore_eos": True}
    out = await small.generate("m", [1] * 10, {**params, "max_tokens": 5})
    assert len(out.token_ids) == 5
    assert out.stop_reason == "length"
    clamped = await small.generate("m", [1] * 20, {**params, "max_tokens": 50})
    assert len(clamped.token_ids) == 4
    assert clamped.stop_reason == "length"
    with pytest.raises(ValueError, match="prompt has 24 tokens but the context is 24"):
        await small.generate("m", [1] * 24, params)
    with pytest.raises(ValueError, match="exceeds the model's max_position_embeddings=2048"):
        HFServer(model_path, max_model_len=4096)
    await small.close()


async def test_abort_returns_promptly_with_the_tokens_so_far(server):
    params = {"max_tokens": 1900, "temperature": 1.0, "ignore_eos": True}
    task = asyncio.ensure_future(server.generate("long", PROMPTS[0], params))
    other = asyncio.ensure_future(server.generate("keep", PROMPTS[2], {**params, "max_tokens": 30}))
    row = await asyncio.wait_for(_decoding_row(server, "long"), HANG_S)
    await server.abort("long")
    # The abort flag is set now; the decode step already past its check may add one more token.
    generated_at_abort = len(row.token_ids)
    out = await asyncio.wait_for(task, HANG_S)
    assert len(out.token_ids) <= generated_at_abort + 1, "abort must end the request within one decode step"
    assert out.stop_reason == "aborted"
    assert 0 < len(out.token_ids) < 1900
    assert len(out.log_probs) == len(out.token_ids)
    kept = await other
    assert kept.stop_reason == "length", "abort must only hit its request id"
    assert len(kept.token_ids) == 30, "abort must only hit its request id"
    await server.abort("no-such-request")  # finished or unknown ids are ignored


async def test_sleep_queues_requests_abort_frees_them_and_outputs_survive(server):
    # A CPU server has no accelerator memory to free; sleep frees its prefix cache (on by default).
    assert server.capabilities.sleep is (server.prefix_cache is not None) is True
    params = {"max_tokens": 6, "temperature": 0}
    before = await server.generate("z", PROMPTS[3], params)
    await server.sleep()
    queued = asyncio.ensure_future(server.generate("q", PROMPTS[3], params))
    waiting = asyncio.ensure_future(server.generate("w", PROMPTS[3], params))
    await asyncio.sleep(0.1)
    assert not queued.done(), "a sleeping server must not serve"
    assert not waiting.done(), "a sleeping server must not serve"
    await server.abort("q")
    aborted = await asyncio.wait_for(queued, HANG_S)
    assert aborted.stop_reason == "aborted"
    assert aborted.token_ids == []
    await server.wake_up()
    assert (await asyncio.wait_for(waiting, HANG_S)).token_ids == before.token_ids


async def test_cancelling_the_caller_stops_the_row(server):
    before = server.stats["generated_tokens"]
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(server.generate("c", PROMPTS[0], {"max_tokens": 1900, "ignore_eos": True}), 0.2)
    await asyncio.sleep(0.2)
    assert server.stats["generated_tokens"] - before < 1900


async def test_update_weights_changes_output_and_restoring_restores_it(model_path):
    engine = HFServer(model_path)
    params = {"max_tokens": 10, "temperature": 0, "ignore_eos": True}
    original = await engine.generate("u", PROMPTS[1], params)
    name = "model.layers.0.mlp.down_proj.weight"
    saved = engine.model.state_dict()[name].clone()
    gen = torch.Generator().manual_seed(0)
    await engine.update_weights([(name, torch.randn(saved.shape, generator=gen))])
    changed = await engine.generate("u", PROMPTS[1], params)
    assert changed.token_ids != original.token_ids
    await engine.update_weights({name: saved})
    restored = await engine.generate("u", PROMPTS[1], params)
    assert restored.token_ids == original.token_ids
    assert restored.log_probs == original.log_probs

    with pytest.raises(KeyError, match="no weight named 'model.layers.0.mlp.down_prj.weight'.*closest"):
        await engine.update_weights([("model.layers.0.mlp.down_prj.weight", saved)])
    with pytest.raises(ValueError, match=r"has shape \(2, 2\), the model expects"):
        await engine.update_weights([(name, torch.zeros(2, 2))])
    await engine.close()
    with pytest.raises(RuntimeError, match="closed"):
        await engine.generate("u", PROMPTS[1], params)


async def test_chat_completion_on_the_tiny_model(server):
    from agentloop_engines.serving.gateway import Gateway

    # What an HTTP server in front of the engine serves on /v1: the gateway over its tokenizer.
    resp = (await Gateway(server, server.tokenizer).chat_completion(
        {"messages": [{"role": "user", "content": "What is 2 + 3?"}], "max_tokens": 8, "temperature": 0}
    )).body
    choice = resp["choices"][0]
    assert resp["object"] == "chat.completion"
    assert choice["message"]["role"] == "assistant"
    assert choice["finish_reason"] in ("stop", "length")
    assert 0 < len(choice["token_ids"]) <= 8
    assert resp["usage"]["completion_tokens"] == len(choice["token_ids"])
    ref = reference_log_probs(server, resp["prompt_token_ids"], choice["token_ids"], 0.0)
    assert choice["token_logprobs"] == pytest.approx(ref, abs=1e-4)


def test_constructor_errors(model_path):
    with pytest.raises(ValueError, match="unknown dtype 'fp8'"):
        HFServer(model_path, dtype="fp8")
    with pytest.raises(ValueError, match="max_batch_size must be >= 1"):
        HFServer(model_path, max_batch_size=0)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="torch.cuda.is_available"):
            HFServer(model_path, device="cuda")


async def test_accepts_a_model_object_and_a_tokenizer_path(model_path):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(model_path))
    engine = HFServer(model, tokenizer=model_path, max_batch_size=2)
    outs = await asyncio.gather(*(engine.generate(f"o{i}", p, {"max_tokens": 4, "temperature": 0}) for i, p in enumerate(PROMPTS)))
    assert all(1 <= len(o.token_ids) <= 4 for o in outs)
    assert max(engine.batch_sizes) <= 2, "max_batch_size caps each batch"
    assert engine.tokenizer is not None
    assert engine.eos_token_ids == (engine.tokenizer.eos_token_id,)
    await engine.close()
    bare = HFServer(model)
    assert bare.tokenizer is None
    await bare.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
async def test_on_cuda(model_path):
    engine = HFServer(model_path, device="cuda")
    assert engine.capabilities.sleep is True
    params = {"max_tokens": 16, "temperature": 0, "ignore_eos": True}
    batched = await asyncio.gather(*(engine.generate(f"g{i}", p, params) for i, p in enumerate(PROMPTS)))
    alone = [await engine.generate(f"a{i}", p, params) for i, p in enumerate(PROMPTS)]
    assert [o.token_ids for o in batched] == [o.token_ids for o in alone]
    assert engine.stats["max_batch_rows"] > 1
    sampled = await asyncio.gather(
        *(engine.generate(f"s{i}", p, {**params, "temperature": 0.7, "seed": i}) for i, p in enumerate(PROMPTS))
    )
    for prompt, out in zip(PROMPTS, sampled, strict=True):
        ref = reference_log_probs(engine, prompt, out.token_ids, 0.7)
        assert max(abs(a - b) for a, b in zip(out.log_probs, ref, strict=True)) < 1e-3
    used = torch.cuda.memory_allocated()
    await engine.sleep()
    assert torch.cuda.memory_allocated() < used
    await engine.wake_up()
    again = await engine.generate("g0", PROMPTS[0], params)
    assert again.token_ids == batched[0].token_ids
    await engine.close()


async def test_requests_arriving_mid_batch_join_it_without_changing_outputs(server):
    long_params = {"max_tokens": 300, "temperature": 0, "ignore_eos": True}
    short_params = {"max_tokens": 10, "temperature": 0, "ignore_eos": True}
    long_alone = await server.generate("L", PROMPTS[1], long_params)
    short_alone = [await server.generate(f"S{i}", p, short_params) for i, p in enumerate(PROMPTS[2:4])]

    before = server.stats["max_batch_rows"]
    server.stats["max_batch_rows"] = 0
    generated = server.stats["generated_tokens"]
    long_task = asyncio.ensure_future(server.generate("L", PROMPTS[1], long_params))
    # Join once the long row is decoding (not after a fixed sleep: a loaded or idle machine
    # would make that either too short or long enough for the long row to finish).
    while server.stats["generated_tokens"] == generated:  # noqa: ASYNC110 - the decode thread bumps a counter; no event marks it
        await asyncio.sleep(0.001)
    assert not long_task.done()
    shorts = await asyncio.gather(*(server.generate(f"S{i}", p, short_params) for i, p in enumerate(PROMPTS[2:4])))
    assert not long_task.done(), "the short requests must not wait for the long one to finish"
    assert server.stats["max_batch_rows"] == 3, "the newcomers should share forward passes with the long row"
    long_out = await long_task
    server.stats["max_batch_rows"] = max(before, server.stats["max_batch_rows"])
    assert [o.token_ids for o in shorts] == [o.token_ids for o in short_alone]
    assert long_out.token_ids == long_alone.token_ids
    for joined, alone in zip(shorts + [long_out], short_alone + [long_alone], strict=True):
        assert joined.log_probs == pytest.approx(alone.log_probs, abs=1e-4)


async def test_update_weights_waits_for_the_running_batch(model_path):
    engine = HFServer(model_path)
    params = {"max_tokens": 200, "temperature": 0, "ignore_eos": True}
    alone = await engine.generate("w", PROMPTS[0], params)
    name = "model.layers.1.self_attn.o_proj.weight"
    saved = engine.model.state_dict()[name].clone()
    generated = engine.stats["generated_tokens"]
    running = asyncio.ensure_future(engine.generate("w", PROMPTS[0], params))
    # Until the batch is decoding (a fixed sleep let an idle machine finish all of it first).
    while engine.stats["generated_tokens"] == generated and not running.done():  # noqa: ASYNC110 - as above: a counter the decode thread bumps
        await asyncio.sleep(0)
    assert not running.done()
    await engine.update_weights([(name, torch.zeros_like(saved))])
    assert (await running).token_ids == alone.token_ids, "a request must be decoded with one set of weights"
    after = await engine.generate("w", PROMPTS[0], params)
    assert after.token_ids != alone.token_ids
    await engine.close()


async def test_prompts_sharing_a_long_prefix_prefill_it_once_without_changing_outputs(model_path):
    # A tool-schema system turn shared by every prompt, then different questions of different
    # lengths (so the tails are left-padded after the shared part).
    system = [(7 * i) % 500 + 20 for i in range(60)]
    prompts = [system + [100 + k] * (1 + k % 4) for k in range(6)]
    shared = HFServer(model_path, max_batch_size=32, batch_wait_s=0.05)
    outs = await asyncio.gather(*(shared.generate(f"p{k}", p, {"max_tokens": 6, "temperature": 0.0})
                                  for k, p in enumerate(prompts)))
    assert shared.stats["shared_prefix_tokens"] == 60 * 5  # prefix computed once for 6 rows
    alone = HFServer(model_path, max_batch_size=1)
    for prompt, out in zip(prompts, outs, strict=True):
        ref = await alone.generate("ref", prompt, {"max_tokens": 6, "temperature": 0.0})
        assert out.token_ids == ref.token_ids
        assert out.log_probs == pytest.approx(ref.log_probs, abs=1e-4)
        assert out.log_probs == pytest.approx(reference_log_probs(alone, prompt, out.token_ids, 1.0), abs=1e-4)
    assert alone.stats["shared_prefix_tokens"] == 0
