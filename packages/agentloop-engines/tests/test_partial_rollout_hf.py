"""Partial rollout on the real HFServer (tiny Qwen2): a generation aborted at a token boundary
by a weight update resumes on the new weights from exactly the tokens already generated.

The checks recompute every token's log-prob with a plain forward pass: the tokens sampled
before the update must score as the OLD weights score them, the tokens after it as the NEW
weights score them on the same prefix, and the versions list must mark the switch point.
The tiny model and its old and new weights are fixtures in ``conftest.py``; the helpers shared
with the HTTP and Ray versions of these tests are in ``partial_rollout_common.py``.
"""

from __future__ import annotations

import asyncio

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

pytest.importorskip("torch", reason='HFServer needs pip install "agentloop-engines[hf]"')
pytest.importorskip("transformers", reason='HFServer needs pip install "agentloop-engines[hf]"')

from agentloop_core.partial_rollout import PartialRolloutServer, resume_seed  # noqa: E402
from agentloop_engines.adapters.hf import HFServer  # noqa: E402


@pytest.fixture
def server(model_path):
    # A fresh engine per test: the tests change its weights.
    return HFServer(model_path, max_batch_size=8, seed=0)


async def _generate_across_update(wrapper: PartialRolloutServer, server: HFServer, weights: dict, params: dict,
                                  request_id: str = "traj-0"):
    task = asyncio.ensure_future(wrapper.generate(request_id, PROMPT, params))
    await asyncio.wait_for(wait_for_tokens([server], request_id, 4, task), HANG_S)
    async with wrapper.weight_update():
        await wrapper.update_weights(weights.items())
    return await asyncio.wait_for(task, HANG_S)


@pytest.mark.parametrize(("temperature", "seed"), [(0.0, None), (1.0, 7)])
async def test_resumed_tokens_score_as_the_new_weights_and_earlier_ones_as_the_old(
        server, model_path, old_weights, new_weights, temperature, seed):
    """The pre-update tokens carry the old weights' log-probs, the resumed ones the new weights'
    on the full prefix; versions mark the switch; the budget covers both parts."""
    wrapper = PartialRolloutServer(server, keep_ledger=True)
    params = {"max_tokens": MAX_TOKENS, "temperature": temperature, "ignore_eos": True, "seed": seed}
    out = await _generate_across_update(wrapper, server, new_weights, params)

    versions = out.extra["policy_versions"]
    k = versions.count(0)
    assert out.extra["resumes"] == 1
    assert 0 < k < MAX_TOKENS, f"the update should land mid-generation; {k} of {MAX_TOKENS} tokens came first"
    assert versions == [0] * k + [1] * (len(out.token_ids) - k), "versions must switch once, at the abort point"
    assert len(out.token_ids) == MAX_TOKENS
    assert out.stop_reason == "length"
    assert len(out.log_probs) == len(out.token_ids)
    assert wrapper.pop_ledger("traj-0") == (out.token_ids, versions)

    old_lp = scorer(model_path, old_weights)(PROMPT, out.token_ids, temperature)
    new_lp = scorer(model_path, new_weights)(PROMPT, out.token_ids, temperature)
    before_err = max_abs(out.log_probs[:k], old_lp[:k])
    after_err = max_abs(out.log_probs[k:], new_lp[k:])
    print(f"T={temperature}: switch after {k} tokens; max |engine - forward| old part {before_err:.2e}, "
          f"new part {after_err:.2e}")
    assert before_err < LOGPROB_TOL, "tokens sampled before the update must carry the old weights' log-probs"
    assert after_err < LOGPROB_TOL, "resumed tokens must carry the new weights' log-probs on the full prefix"
    # The check can fail: the two policies really score the resumed tokens differently.
    assert max_abs(out.log_probs[k:], old_lp[k:]) > 1e-2


async def test_greedy_resume_continues_exactly_from_the_generated_prefix(server, new_weights):
    """After the update, the resumed part is what the new weights generate from prompt + the
    kept prefix: the same token ids, not a re-encoding and not a restart."""
    wrapper = PartialRolloutServer(server)
    out = await _generate_across_update(wrapper, server, new_weights, GREEDY)
    k = out.extra["policy_versions"].count(0)
    fresh = await server.generate("check", PROMPT + out.token_ids[:k], {**GREEDY, "max_tokens": MAX_TOKENS - k})
    assert out.token_ids[k:] == fresh.token_ids


async def test_an_update_to_the_same_weights_leaves_greedy_output_unchanged(server, old_weights):
    """Abort + resume is invisible when the weights do not change: the output equals an
    uninterrupted generation token for token."""
    plain = await server.generate("plain", PROMPT, GREEDY)
    wrapper = PartialRolloutServer(server)
    out = await _generate_across_update(wrapper, server, old_weights, GREEDY)
    assert out.extra["resumes"] == 1
    assert out.token_ids == plain.token_ids
    assert max_abs(out.log_probs, plain.log_probs) < LOGPROB_TOL


async def test_concurrent_generations_all_resume_within_their_budgets(server, new_weights):
    """Every in-flight generation is interrupted and resumed; queued and finished ones are fine."""
    wrapper = PartialRolloutServer(server)
    budgets = [MAX_TOKENS, 40, MAX_TOKENS + 20, 3]
    params = [{**GREEDY, "max_tokens": b} for b in budgets]
    tasks = [asyncio.ensure_future(wrapper.generate(f"c{i}", PROMPT[: 2 + i], p)) for i, p in enumerate(params)]
    await asyncio.wait_for(wait_for_tokens([server], "c0", 4, tasks[0]), HANG_S)
    async with wrapper.weight_update(policy_version=5):
        await wrapper.update_weights(new_weights.items())
    outs = await asyncio.wait_for(asyncio.gather(*tasks), HANG_S)
    for budget, out in zip(budgets, outs, strict=True):
        assert len(out.token_ids) == budget
        assert out.stop_reason == "length"
        versions = out.extra["policy_versions"]
        assert set(versions) <= {0, 5}
        assert versions == sorted(versions)
    assert wrapper.policy_version == 5
    assert 5 in outs[0].extra["policy_versions"]
    assert 0 in outs[0].extra["policy_versions"]


async def test_a_callers_abort_is_not_resumed(server):
    """``abort`` through the wrapper is the caller's: the generation ends ``aborted``."""
    wrapper = PartialRolloutServer(server)
    task = asyncio.ensure_future(wrapper.generate("mine", PROMPT, {"max_tokens": 1500, "ignore_eos": True}))
    await asyncio.wait_for(wait_for_tokens([server], "mine", 2, task), HANG_S)
    await wrapper.abort("mine")
    out = await asyncio.wait_for(task, HANG_S)
    assert out.stop_reason == "aborted"
    assert out.extra["resumes"] == 0
    assert 0 < len(out.token_ids) < 1500


async def test_update_outside_a_weight_update_block_is_a_whole_update(server, new_weights):
    """A bare ``update_weights`` pauses, pushes, bumps the version and resumes by itself."""
    wrapper = PartialRolloutServer(server, policy_version=3)
    task = asyncio.ensure_future(wrapper.generate("bare", PROMPT, GREEDY))
    await asyncio.wait_for(wait_for_tokens([server], "bare", 4, task), HANG_S)
    await wrapper.update_weights(new_weights.items())
    out = await asyncio.wait_for(task, HANG_S)
    assert wrapper.policy_version == 4
    assert not wrapper.paused
    assert set(out.extra["policy_versions"]) == {3, 4}


def test_resume_seed_is_deterministic_and_moves_the_stream():
    assert resume_seed(None, 5) is None
    assert resume_seed(7, 5) == resume_seed(7, 5)
    assert len({7, resume_seed(7, 5), resume_seed(7, 6), resume_seed(8, 5)}) == 4
    assert 0 <= resume_seed(7, 5) < 2**63
