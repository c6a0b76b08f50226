"""Which limit stopped a generate call, and the batch's ``rollout/truncated/*`` fractions."""

from __future__ import annotations

import pytest

from agentloop_core.batch import RolloutBatch
from agentloop_core.output import AgentLoopOutput
from agentloop_core.single_turn import SingleTurnAgentLoop
from agentloop_core.stops import CONTEXT, RESPONSE_BUDGET, TURN_CAP, TURNS, StopCounter, length_stop_cause
from agentloop_core.testing import ScriptedServer, load_tiny_tokenizer


@pytest.mark.parametrize(("args", "cause"), [
    (("stop", 5, 64, 64), None),
    (("aborted", 5, 64, 64), None),
    (("length", 64, 64, 64), "turn_cap"),  # asked for the cap, got it all
    (("length", 10, 10, 64), "response_budget"),  # asked for what was left of the budget
    (("length", 30, 64, 64), "context"),  # the engine gave fewer than asked: its context
    (("length", 20, 20, None), "response_budget"),  # no cap: the budget was the limit
])
def test_length_stop_cause(args, cause):
    assert length_stop_cause(*args) == cause


def _out(length: int, **metrics: float) -> AgentLoopOutput:
    return AgentLoopOutput(prompt_ids=[1], response_ids=[2] * length, response_mask=[1] * length, reward_score=0.0,
                           metrics=dict(metrics))


def test_batch_fractions():
    capped = StopCounter()
    capped.add("length", 8, 8, 8)
    capped.add("stop", 3, 8, 8)
    clean = StopCounter()
    clean.add("stop", 3, 8, 8)
    context = StopCounter()
    context.add("length", 2, 8, 8)
    outputs = [_out(11, **capped.metrics()), _out(3, **clean.metrics()), _out(2, **context.metrics()),
               _out(12, **clean.metrics())]
    m = RolloutBatch.from_outputs(outputs, pad_token_id=0, response_length=12).metrics
    assert m["rollout/truncated/turn_cap"] == 0.25
    assert m["rollout/truncated/turn_cap_turns"] == 1 / 5
    assert m["rollout/truncated/context"] == 0.25
    assert m["rollout/truncated/response_budget"] == 0.25  # the one 12 tokens long: the whole budget
    assert m["rollout/truncated/any"] == 0.75
    assert m["rollout/response_clip_fraction"] == 0.25


def test_clip_fraction_needs_the_real_limit():
    # Without a response budget the padded width is the longest response, which some row always
    # fills: that is no clipping, so the metric is left out instead of reporting 1/B.
    m = RolloutBatch.from_outputs([_out(3), _out(5)], pad_token_id=0).metrics
    assert "rollout/response_clip_fraction" not in m
    assert m["rollout/truncated/response_budget"] == 0
    assert "rollout/truncated/turn_cap" not in m
    m = RolloutBatch.from_outputs([_out(3), _out(5)], pad_token_id=0, response_length=8).metrics
    assert m["rollout/response_clip_fraction"] == 0


async def test_single_turn_loop_reports_its_stop():
    tokenizer = load_tiny_tokenizer()
    text = tokenizer.encode("one two three four five six seven eight nine ten", add_special_tokens=False)
    server = ScriptedServer(lambda *_: text, eos_token_id=tokenizer.eos_token_id)
    loop = SingleTurnAgentLoop(server, tokenizer, {"response_length": 100})
    out = await loop.run({"max_tokens": 4}, raw_prompt=[{"role": "user", "content": "count"}])
    assert out.metrics[TURNS] == 1
    assert out.metrics[TURN_CAP] == 1
    assert out.metrics[RESPONSE_BUDGET] == 0
    out = await SingleTurnAgentLoop(server, tokenizer, {"response_length": 3}).run(
        {"max_tokens": 4}, raw_prompt=[{"role": "user", "content": "count"}])
    assert out.metrics[RESPONSE_BUDGET] == 1
    assert out.metrics[TURN_CAP] == 0
    assert out.metrics[CONTEXT] == 0


def test_rows_of_trajectories_cut_short():
    """``RolloutBatch.stopped_on_a_limit``: every row of a trajectory with a turn stopped by a
    length limit, or cut by the padding, and no other row."""
    capped, clean, context, budget = StopCounter(), StopCounter(), StopCounter(), StopCounter()
    capped.add("length", 8, 8, 8)
    clean.add("stop", 3, 8, 8)
    context.add("length", 2, 8, 8)
    budget.add("length", 4, 4, 8)

    def seg(t: int, k: int, counter: StopCounter, length: int = 3) -> AgentLoopOutput:
        out = _out(length, **counter.metrics())
        out.trajectory_index, out.segment_index = t, k
        return out

    outputs = [seg(0, 0, clean), seg(1, 0, capped), seg(2, 0, context), seg(3, 0, budget),
               seg(4, 0, capped), seg(4, 1, clean),  # a segmented trajectory: the cut marks both rows
               seg(5, 0, clean, length=9), seg(6, 0, clean)]
    batch = RolloutBatch.from_outputs(outputs, pad_token_id=0, response_length=8, truncate=True)
    assert batch.stopped_on_a_limit().tolist() == [False, True, True, True, True, True, True, False]
