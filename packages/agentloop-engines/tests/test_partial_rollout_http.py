"""Partial rollout over remote engines: PartialRolloutServer in front of a routing client over
``EngineHTTPClient`` clients, each talking to a real HFServer behind our HTTP server on 127.0.0.1
(what ``actor_rollout_ref.rollout.server_urls`` builds).

It works because ``POST /abort`` stops the engine's request at a token boundary and the
in-flight ``POST /generate`` then answers with the tokens (and log-probs) generated so far and
``stop_reason="aborted"``; these tests check that over the wire, then the whole abort-update-resume
cycle against a plain forward pass on the old and new weights. The tiny model and its old and
new weights are fixtures in ``conftest.py``; the shared helpers are in ``partial_rollout_common.py``.
"""

from __future__ import annotations

import asyncio
import contextlib

import pytest
from partial_rollout_common import (
    GREEDY,
    HANG_S,
    LOGPROB_TOL,
    MAX_TOKENS,
    PROMPT,
    max_abs,
    scorer,
    wait_for_tokens,
)

pytest.importorskip("httpx", reason='HTTP tests need: pip install "agentloop-engines[server]"')
pytest.importorskip("fastapi", reason='HTTP tests need: pip install "agentloop-engines[server]"')
pytest.importorskip("uvicorn", reason='HTTP tests need: pip install "agentloop-engines[server]"')
pytest.importorskip("torch", reason='HFServer needs pip install "agentloop-engines[hf]"')
pytest.importorskip("transformers", reason='HFServer needs pip install "agentloop-engines[hf]"')
pytest.importorskip("safetensors", reason='weight sync needs pip install "agentloop-engines[hf]"')

from agentloop_core.partial_rollout import PartialRolloutServer  # noqa: E402
from agentloop_engines import EngineHTTPClient  # noqa: E402
from agentloop_engines.adapters.hf import HFServer  # noqa: E402
from agentloop_engines.fleet.client import LLMServerClient  # noqa: E402
from agentloop_engines.serving.server import ServerThread  # noqa: E402


@pytest.fixture
async def remote(model_path):
    """``start(n)`` -> (engines, routing client over n HTTP servers); all stopped after the test."""
    with contextlib.ExitStack() as stack:
        clients: list[EngineHTTPClient] = []

        async def start(n: int = 1) -> tuple[list[HFServer], LLMServerClient]:
            engines = [HFServer(model_path, max_model_len=512, max_batch_size=8, seed=0) for _ in range(n)]
            for engine in engines:
                thread = stack.enter_context(ServerThread(engine))
                clients.append(EngineHTTPClient(thread.url, control_key=thread.control_key))
                await clients[-1].connect()
            return engines, LLMServerClient(clients[-n:])

        yield start
        for client in clients:
            await client.close()


async def test_abort_over_http_returns_the_tokens_generated_so_far(remote, model_path, old_weights):
    """``/abort`` makes the in-flight ``/generate`` answer ``aborted`` with its partial tokens
    and their log-probs (the contract partial rollout needs); they are the start of an
    uninterrupted greedy run. Empty tokens here: the server dropped them on abort."""
    engines, client = await remote(1)
    plain = await client.generate("plain", PROMPT, GREEDY)
    task = asyncio.ensure_future(client.generate("cut", PROMPT, GREEDY))
    await asyncio.wait_for(wait_for_tokens(engines, "cut", 4, task), HANG_S)
    await client.abort("cut")
    out = await asyncio.wait_for(task, HANG_S)
    k = len(out.token_ids)
    assert out.stop_reason == "aborted"
    assert 4 <= k < MAX_TOKENS
    assert out.token_ids == plain.token_ids[:k]
    assert max_abs(out.log_probs, plain.log_probs[:k]) < LOGPROB_TOL
    assert max_abs(out.log_probs, scorer(model_path, old_weights)(PROMPT, out.token_ids)) < LOGPROB_TOL


async def test_a_weight_update_over_http_resumes_from_exactly_the_generated_prefix(
        remote, model_path, old_weights, new_weights):
    """An update mid-generation (weights pushed as a safetensors body) aborts the call over
    HTTP and resumes it from prompt + the kept prefix: the prefix is the old weights' greedy
    run, the rest is what the new weights generate from there, log-probs included."""
    engines, client = await remote(1)
    plain = await client.generate("plain", PROMPT, GREEDY)
    wrapper = PartialRolloutServer(client, keep_ledger=True)
    task = asyncio.ensure_future(wrapper.generate("traj-0", PROMPT, GREEDY))
    await asyncio.wait_for(wait_for_tokens(engines, "traj-0", 4, task), HANG_S)
    await wrapper.update_weights(new_weights.items())
    out = await asyncio.wait_for(task, HANG_S)

    versions = out.extra["policy_versions"]
    k = versions.count(0)
    assert out.extra["resumes"] == 1
    assert 0 < k < MAX_TOKENS, f"the update should land mid-generation; {k} of {MAX_TOKENS} tokens came first"
    assert versions == [0] * k + [1] * (MAX_TOKENS - k)
    assert len(out.token_ids) == MAX_TOKENS
    assert out.stop_reason == "length"
    assert wrapper.pop_ledger("traj-0") == (out.token_ids, versions)

    fresh = await client.generate("check", PROMPT + out.token_ids[:k], {**GREEDY, "max_tokens": MAX_TOKENS - k})
    old_lp = scorer(model_path, old_weights)(PROMPT, out.token_ids)
    new_lp = scorer(model_path, new_weights)(PROMPT, out.token_ids)
    print(f"switch after {k} tokens; max |engine - forward| old part {max_abs(out.log_probs[:k], old_lp[:k]):.2e}, "
          f"new part {max_abs(out.log_probs[k:], new_lp[k:]):.2e}")
    assert out.token_ids[:k] == plain.token_ids[:k]
    assert out.token_ids[k:] == fresh.token_ids
    assert max_abs(out.log_probs[:k], old_lp[:k]) < LOGPROB_TOL
    assert max_abs(out.log_probs[k:], new_lp[k:]) < LOGPROB_TOL
    # The check can fail: the two policies really score the resumed tokens differently.
    assert max_abs(out.log_probs[k:], old_lp[k:]) > 1e-2


async def test_generations_on_two_replicas_all_resume_on_the_new_weights(remote, model_path, new_weights):
    """With two remote replicas each in-flight generation is aborted on its own replica, every
    replica gets the new weights, and every generation resumes within its budget."""
    engines, client = await remote(2)
    wrapper = PartialRolloutServer(client)
    ids = [f"r{i}" for i in range(4)]
    tasks = [asyncio.ensure_future(wrapper.generate(rid, PROMPT[: 2 + i], GREEDY)) for i, rid in enumerate(ids)]
    for rid, task in zip(ids, tasks, strict=True):
        await asyncio.wait_for(wait_for_tokens(engines, rid, 2, task), HANG_S)
    assert {client.policy.session_replica(rid) for rid in ids} == {0, 1}, "both replicas should hold generations"
    await wrapper.update_weights(new_weights.items())
    outs = await asyncio.wait_for(asyncio.gather(*tasks), HANG_S)
    for rid, out in zip(ids, outs, strict=True):
        versions = out.extra["policy_versions"]
        assert len(out.token_ids) == MAX_TOKENS, rid
        assert out.stop_reason == "length", rid
        assert out.extra["resumes"] == 1, rid
        assert 0 < versions.count(0) < MAX_TOKENS, rid
        assert versions == sorted(versions), rid
    # Every replica really holds the new weights: its greedy tokens score as the new weights'.
    score_new = scorer(model_path, new_weights)
    for replica in client.replicas:
        after = await replica.generate("after", PROMPT, {**GREEDY, "max_tokens": 16})
        assert max_abs(after.log_probs, score_new(PROMPT, after.token_ids)) < LOGPROB_TOL, replica
