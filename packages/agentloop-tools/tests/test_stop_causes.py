"""The tool loop counts which limit stopped each turn (``stop/*`` metrics), from the engine's
stop reason and the budget it asked for: the per-turn cap, the response budget, the context.
A scripted engine with the real validation (it clamps ``max_tokens`` to its context as the real
engines do), the tiny tokenizer and the real calculator tool."""

from __future__ import annotations

import json

import pytest

from agentloop_core.batch import RolloutBatch
from agentloop_core.stops import CONTEXT, RESPONSE_BUDGET, TURN_CAP, TURNS
from agentloop_core.testing import ScriptedServer, load_tiny_tokenizer
from agentloop_tools.agent_loop import ToolAgentLoop
from agentloop_tools.builtin import calculator

PROMPT = [{"role": "user", "content": "What is 12 + 7?"}]
LONG = "Let me think about this step by step, carefully, one number at a time. " * 4


@pytest.fixture(scope="module")
def tokenizer():
    return load_tiny_tokenizer()


def _call(expression: str) -> str:
    return "<tool_call>\n" + json.dumps({"name": "calculator", "arguments": {"expression": expression}}) + "\n</tool_call>"


async def _run(tokenizer, turns, max_tokens=None, response_length=2048, max_model_len=4096):
    def reply(request_id, prompt_ids, index):
        return tokenizer.encode(turns[min(index, len(turns) - 1)], add_special_tokens=False)

    server = ScriptedServer(reply, eos_token_id=tokenizer.eos_token_id, append_eos=True, max_model_len=max_model_len)
    loop = ToolAgentLoop(server, tokenizer, {"tools": {"calculator": calculator}, "response_length": response_length})
    params = {"temperature": 0.0, **({"max_tokens": max_tokens} if max_tokens else {})}
    return await loop.run(params, raw_prompt=PROMPT), server


async def test_a_turn_cut_by_the_per_turn_cap(tokenizer):
    out, server = await _run(tokenizer, [_call("12+7"), LONG], max_tokens=32)
    assert [c.output.stop_reason for c in server.calls] == ["stop", "length"]
    assert out.metrics[TURNS] == 2
    assert out.metrics[TURN_CAP] == 1
    assert out.metrics[CONTEXT] == 0
    assert out.metrics[RESPONSE_BUDGET] == 0
    assert out.extra_fields["termination_reason"] == "length"


async def test_a_turn_that_ends_on_its_own_is_not_counted(tokenizer):
    out, _ = await _run(tokenizer, [_call("12+7"), "#### 19"], max_tokens=64)
    assert out.metrics[TURNS] == 2
    assert out.metrics[TURN_CAP] == 0
    assert out.metrics[RESPONSE_BUDGET] == 0


async def test_the_response_budget(tokenizer):
    out, server = await _run(tokenizer, [LONG], max_tokens=64, response_length=20)
    assert server.calls[0].sampling_params.max_tokens == 20  # the budget, smaller than the cap
    assert out.metrics[RESPONSE_BUDGET] == 1
    assert out.metrics[TURN_CAP] == 0


async def test_a_tool_result_that_no_longer_fits_is_the_response_budget(tokenizer):
    first = len(tokenizer.encode(_call("12+7"), add_special_tokens=False)) + 1
    out, _ = await _run(tokenizer, [_call("12+7"), "#### 19"], max_tokens=64, response_length=first + 3)
    assert out.extra_fields["termination_reason"] == "response_length"
    assert out.metrics[RESPONSE_BUDGET] == 1
    assert out.metrics[TURN_CAP] == 0
    assert out.metrics[TURNS] == 1


async def test_the_engine_context(tokenizer):
    prompt_tokens = len(ToolAgentLoop(ScriptedServer(), tokenizer, {"tools": {"calculator": calculator},
                                                                    "response_length": 64}).renderer.render_prompt(PROMPT))
    out, server = await _run(tokenizer, [LONG], max_tokens=64, max_model_len=prompt_tokens + 10)
    assert server.calls[0].output.stop_reason == "length"
    assert len(server.calls[0].output.token_ids) < 64
    assert out.metrics[CONTEXT] == 1
    assert out.metrics[TURN_CAP] == 0


async def test_batch_fractions_of_samples_and_turns(tokenizer):
    capped, _ = await _run(tokenizer, [_call("12+7"), LONG], max_tokens=32)
    clean, _ = await _run(tokenizer, [_call("12+7"), "#### 19"], max_tokens=32)
    m = RolloutBatch.from_outputs([capped, clean, clean, clean], pad_token_id=0, response_length=2048).metrics
    assert m["rollout/truncated/turn_cap"] == 0.25  # of samples
    assert m["rollout/truncated/turn_cap_turns"] == 1 / 8  # of turns
    assert m["rollout/truncated/response_budget"] == 0
    assert m["rollout/truncated/context"] == 0
    assert m["rollout/response_clip_fraction"] == 0  # no response reached the 2048-token budget
    assert not any(k.startswith("agent_loop/stop/") for k in m)  # one name per concept
