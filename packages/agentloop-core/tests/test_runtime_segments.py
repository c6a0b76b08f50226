"""Loops that return several segments: the worker numbers them and scores the trajectory once,
the manager and RolloutBatch keep them together, and failures stay one row per sample."""

from __future__ import annotations

import uuid

import numpy as np
import pytest

import agentloop_core.testing.loops  # noqa: F401  registers test_chat
from agentloop_core.batch import RolloutBatch
from agentloop_core.loop import AgentLoopBase
from agentloop_core.output import AgentLoopOutput
from agentloop_core.registry import register
from agentloop_core.runtime import AgentLoopManager, AgentLoopWorker
from agentloop_core.segments import SegmentBuilder
from agentloop_core.testing import ScriptedServer, load_tiny_tokenizer
from agentloop_core.testing.loops import TEST_CHAT_AGENT

SUMMARISING = "test_summarising"


@register(SUMMARISING)
class SummarisingLoop(AgentLoopBase):
    """Generates, appends a tool result and generates again (one segment), then replaces its
    history with a short summary and generates once more (a second segment).

    Row keys: ``index``; ``fail_after_summary`` (raise once the second segment exists);
    ``no_summary`` (stop after the first segment); ``reward`` (the loop's own reward)."""

    async def run(self, sampling_params, **row):
        rid = uuid.uuid4().hex
        builder = SegmentBuilder()
        prompt = [1, 2, 3, 100 + row["index"]]
        out = await self.server.generate(rid, prompt, sampling_params)
        builder.add_output(prompt, out)
        prompt = prompt + out.token_ids + [7, 7]  # a tool result: mask 0
        out = await self.server.generate(rid, prompt, sampling_params)
        builder.add_output(prompt, out)
        if not row.get("no_summary"):
            prompt = [1, 2, 9, 100 + row["index"]]  # the summary replaces the history
            out = await self.server.generate(rid, prompt, sampling_params)
            builder.add_output(prompt, out)
            if row.get("fail_after_summary"):
                raise RuntimeError("the summariser crashed")
        return builder.outputs(reward_score=row.get("reward"), num_turns=3,
                               metrics={"generate_s": 0.01, "tool_calls": 1})


CONFIG = {"default_agent_loop": SUMMARISING, "sampling_params": {"max_tokens": 3}}


@pytest.fixture(scope="module")
def tokenizer():
    return load_tiny_tokenizer()


def rows(n: int, **extra) -> list[dict]:
    return [{"index": i, "reward": float(i % 2), **extra} for i in range(n)]


class TrajectoryReward:
    """Scores the whole trajectory: 1.0 per generated token (the view holds all of them)."""

    def __init__(self):
        self.seen: list[tuple[int, int]] = []

    async def __call__(self, output, row, tokenizer):
        self.seen.append((row["index"], sum(output.response_mask)))
        output.metrics["reward/function"] = float(sum(output.response_mask))
        output.reward_score = float(sum(output.response_mask))


async def test_worker_numbers_segments_and_scores_each_trajectory_once(tokenizer):
    server = ScriptedServer()
    reward = TrajectoryReward()
    worker = AgentLoopWorker(server, tokenizer, {**CONFIG, "reward_fn": reward})
    outputs = await worker.generate_sequences(rows(3), sample_offset=5)
    assert [(o.trajectory_index, o.segment_index) for o in outputs] == [
        (5, 0), (5, 1), (6, 0), (6, 1), (7, 0), (7, 1)]  # fmt: skip
    # reward_fn ran once per trajectory, on all 9 generated tokens (3 calls x 3)
    assert sorted(reward.seen) == [(0, 9), (1, 9), (2, 9)]
    for o in outputs:
        assert o.reward_score == 9.0
        assert o.metrics["reward/function"] == 9.0
        assert o.metrics["agent_name"] == SUMMARISING
        assert o.metrics["reward_s"] >= 0
    # The mask-1 tokens of a trajectory's segments are what the engine generated, in order.
    by_request: dict[str, list[int]] = {}
    for call in server.calls:
        by_request.setdefault(call.request_id, []).extend(call.output.token_ids)
    trained = [[t for o in outputs[2 * k : 2 * k + 2] for t, m in zip(o.response_ids, o.response_mask, strict=True) if m]
               for k in range(3)]
    assert sorted(trained) == sorted(by_request.values())
    assert outputs[0].response_mask == [1, 1, 1, 0, 0, 1, 1, 1]
    assert outputs[1].prompt_ids == [1, 2, 9, 100]


async def test_without_reward_fn_the_loops_reward_reaches_every_segment(tokenizer):
    worker = AgentLoopWorker(ScriptedServer(), tokenizer, CONFIG)
    outputs = await worker.generate_sequences(rows(2))
    assert [o.reward_score for o in outputs] == [0.0, 0.0, 1.0, 1.0]


@register("test_last_only_reward")
class LastOnlyReward(AgentLoopBase):
    async def run(self, sampling_params, **row):
        builder = SegmentBuilder()
        for prompt in ([1, 2], [3, 4]):
            builder.add_output(prompt, await self.server.generate("r", prompt, sampling_params))
        first, last = builder.outputs()
        last.reward_score = 2.0
        if row.get("conflict"):
            first.reward_score = 1.0
        return [first, last]


async def test_a_reward_on_the_last_segment_is_shared_and_conflicting_rewards_fail_the_sample(tokenizer):
    worker = AgentLoopWorker(ScriptedServer(), tokenizer, {**CONFIG, "default_agent_loop": "test_last_only_reward"})
    outputs = await worker.generate_sequences([{}, {"conflict": True}])
    assert [o.reward_score for o in outputs[:2]] == [2.0, 2.0]
    assert len(outputs) == 3
    assert outputs[2].failed
    assert outputs[2].trajectory_index == 1
    assert "segment 0 has reward_score 1.0 but the last segment has 2.0" in outputs[2].metrics["error"]


async def test_a_failing_trajectory_is_one_failed_output(tokenizer):
    sample_rows = rows(3)
    sample_rows[1]["fail_after_summary"] = True
    outputs = await AgentLoopWorker(ScriptedServer(), tokenizer, CONFIG).generate_sequences(sample_rows)
    assert [(o.trajectory_index, o.segment_index, o.failed) for o in outputs] == [
        (0, 0, False), (0, 1, False), (1, 0, True), (2, 0, False), (2, 1, False)]  # fmt: skip
    assert "the summariser crashed" in outputs[2].metrics["error"]


@register("test_bad_return")
class BadReturnLoop(AgentLoopBase):
    async def run(self, sampling_params, **row):
        return row["value"]


async def test_run_must_return_an_output_or_a_non_empty_list_of_them(tokenizer):
    worker = AgentLoopWorker(ScriptedServer(), tokenizer, {**CONFIG, "default_agent_loop": "test_bad_return"})
    ok = AgentLoopOutput([1], [2], [1])
    outputs = await worker.generate_sequences([{"value": []}, {"value": [ok, "x"]}, {"value": (ok,)}])
    assert "returned an empty list; return at least one AgentLoopOutput" in outputs[0].metrics["error"]
    assert "returned list of AgentLoopOutput, str; run() must return an AgentLoopOutput or a list" in outputs[1].metrics["error"]
    assert not outputs[2].failed
    assert outputs[2].trajectory_index == 2


def test_manager_batch_keeps_segments_of_a_trajectory_together(tokenizer):
    sample_rows = rows(6)
    sample_rows[2]["fail_after_summary"] = True
    sample_rows[4]["no_summary"] = True  # a trajectory of one segment beside split ones
    sample_rows.append({"index": 6, "agent_name": TEST_CHAT_AGENT, "raw_prompt": [{"role": "user", "content": "hi"}]})
    with AgentLoopManager(ScriptedServer(), tokenizer, {**CONFIG, "pad_token_id": 0}, num_workers=3) as manager:
        batch = manager.generate_sequences(sample_rows)
    np.testing.assert_array_equal(batch.trajectory_index, [0, 0, 1, 1, 2, 3, 3, 4, 5, 5, 6])
    np.testing.assert_array_equal(batch.segment_index, [0, 1, 0, 1, 0, 0, 1, 0, 0, 1, 0])
    np.testing.assert_array_equal(np.flatnonzero(batch.failed), [4])
    np.testing.assert_array_equal(batch.last_segment_rows(), [1, 3, 4, 6, 7, 9, 10])
    assert len(batch) == 11
    assert batch.num_trajectories == 7
    assert batch.num_failed == 1
    # the loop's reward (index % 2) is shared by a trajectory's segments
    np.testing.assert_array_equal(batch.rewards[:4], [0.0, 0.0, 1.0, 1.0])
    m = batch.metrics
    assert m["rollout/num_samples"] == 7
    assert m["rollout/num_failed"] == 1
    assert m["rollout/failed_fraction"] == pytest.approx(1 / 7)
    # over the 6 successful trajectories: four of 2 segments, two of 1
    assert m["agent_loop/num_segments/mean"] == pytest.approx(10 / 6)
    assert m["agent_loop/num_segments/max"] == 2
    # counted once per trajectory (the test_chat sample reports no tool_calls: 0)
    assert m["agent_loop/tool_calls/mean"] == pytest.approx(5 / 6)
    assert m["rollout/generated_tokens/mean"] == pytest.approx(
        batch.response_mask[~batch.failed].sum() / (~batch.failed).sum())  # per row


def seg(t, k, reward=None, failed=False):
    if failed:
        return AgentLoopOutput.failure(None, "boom", trajectory_index=t)
    return AgentLoopOutput([1, 2], [3, 4], [1, 0], [-0.1, 0.0], reward_score=reward, trajectory_index=t,
                           segment_index=k, num_turns=k + 2)


def test_rolloutbatch_rows_indices_and_checks():
    batch = RolloutBatch.from_outputs([seg(3, 0), seg(3, 1, 1.0), seg(8, 0, 0.5)], pad_token_id=0)
    np.testing.assert_array_equal(batch.trajectory_index, [3, 3, 8])
    np.testing.assert_array_equal(batch.rewards, [1.0, 1.0, 0.5])
    np.testing.assert_array_equal(batch.has_reward, [True, True, True])
    assert batch.metrics["rollout/num_turns/mean"] == 2.5  # last segments: 3 and 2 turns
    # a failed segment fails the whole trajectory
    batch = RolloutBatch.from_outputs([seg(0, 0, 1.0), seg(0, 1, 1.0), seg(1, 0, 1.0)], pad_token_id=0)
    assert batch.num_failed == 0
    one_failed = [seg(0, 0, 1.0), seg(0, 1, failed=True), seg(1, 0, 1.0)]
    one_failed[1].segment_index = 1
    batch = RolloutBatch.from_outputs(one_failed, pad_token_id=0)
    np.testing.assert_array_equal(batch.failed, [True, True, False])
    np.testing.assert_array_equal(batch.rewards, [0.0, 0.0, 1.0])
    assert batch.num_failed == 1
    assert batch.metrics["rollout/failed_fraction"] == 0.5
    with pytest.raises(ValueError, match=r"outputs \[1\] have no trajectory_index while others do"):
        RolloutBatch.from_outputs([seg(0, 0), AgentLoopOutput([1], [2], [1])], pad_token_id=0)
    with pytest.raises(ValueError, match=r"trajectory 0 has segment indices \[0, 0\]; its outputs need segment_index 0..1"):
        RolloutBatch.from_outputs([seg(0, 0), seg(0, 0)], pad_token_id=0)
    with pytest.raises(ValueError, match="segment 0 has reward_score 1.0 but the last segment has 2.0"):
        RolloutBatch.from_outputs([seg(0, 0, 1.0), seg(0, 1, 2.0)], pad_token_id=0)
