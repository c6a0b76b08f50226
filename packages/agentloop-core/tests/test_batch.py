"""RolloutBatch padding math, metrics, truncation, and the no-torch-at-import rule."""

from __future__ import annotations

import math
import subprocess
import sys

import numpy as np
import pytest

from agentloop_core.batch import RolloutBatch, SequenceTooLongError
from agentloop_core.output import AgentLoopOutput


def two_outputs() -> list[AgentLoopOutput]:
    a = AgentLoopOutput(
        prompt_ids=[5, 6],
        response_ids=[7, 8, 9],
        response_mask=[1, 0, 1],
        response_logprobs=[-0.1, -7.0, -0.3],  # the mask-0 entry must not reach the batch
        reward_score=1.0,
        num_turns=3,
        metrics={"generate_s": 0.5, "tool_calls_s": 0.25, "agent_name": "x"},
        extra_fields={"k": 1},
    )
    b = AgentLoopOutput(
        prompt_ids=[1, 2, 3],
        response_ids=[4],
        response_mask=[1],
        response_logprobs=[-0.5],
        reward_score=None,
        num_turns=2,
        metrics={"generate_s": 1.5},
    )
    return [a, b]


def test_padding_matches_hand_computed_arrays():
    batch = RolloutBatch.from_outputs(two_outputs(), prompt_length=4, response_length=3, pad_token_id=0)
    np.testing.assert_array_equal(batch.prompts, [[0, 0, 5, 6], [0, 1, 2, 3]])
    np.testing.assert_array_equal(batch.responses, [[7, 8, 9], [4, 0, 0]])
    np.testing.assert_array_equal(batch.response_mask, [[1, 0, 1], [1, 0, 0]])
    np.testing.assert_array_equal(batch.input_ids, [[0, 0, 5, 6, 7, 8, 9], [0, 1, 2, 3, 4, 0, 0]])
    np.testing.assert_array_equal(batch.attention_mask, [[0, 0, 1, 1, 1, 1, 1], [0, 1, 1, 1, 1, 0, 0]])
    np.testing.assert_array_equal(batch.position_ids, [[0, 0, 0, 1, 2, 3, 4], [0, 0, 1, 2, 3, 3, 3]])
    np.testing.assert_allclose(batch.rollout_log_probs, [[-0.1, 0.0, -0.3], [-0.5, 0.0, 0.0]], rtol=1e-6)
    np.testing.assert_array_equal(batch.rewards, [1.0, 0.0])
    np.testing.assert_array_equal(batch.has_reward, [True, False])
    np.testing.assert_array_equal(batch.num_turns, [3, 2])
    np.testing.assert_array_equal(batch.failed, [False, False])
    assert batch.input_ids.dtype == np.int64
    assert batch.rollout_log_probs.dtype == np.float32
    assert batch.extra_fields == [{"k": 1}, {}]
    assert len(batch) == 2
    # outputs without a trajectory_index are a trajectory each, of one segment
    np.testing.assert_array_equal(batch.trajectory_index, [0, 1])
    np.testing.assert_array_equal(batch.segment_index, [0, 0])
    assert batch.num_trajectories == 2
    assert batch.last_segment_rows().tolist() == [0, 1]


def test_metrics_timing_and_lengths():
    m = RolloutBatch.from_outputs(two_outputs(), prompt_length=4, response_length=3, pad_token_id=0).metrics
    assert m["timing_s/agent_loop/generate/min"] == 0.5
    assert m["timing_s/agent_loop/generate/max"] == 1.5
    assert m["timing_s/agent_loop/generate/mean"] == 1.0
    assert m["timing_s/agent_loop/tool_calls/mean"] == 0.25  # only samples that report it
    assert m["rollout/response_length/mean"] == 2.0
    assert m["rollout/generated_tokens/mean"] == 1.5
    assert m["rollout/response_clip_fraction"] == 0.5
    assert m["rollout/num_failed"] == 0
    assert m["rollout/reward/mean"] == 1.0


def test_numeric_sample_metrics_become_mean_and_max_over_successful_samples():
    a, b = two_outputs()
    a.metrics.update({"tool_calls": 3, "tool/calc/attempts": 2.0, "flag": True})
    b.metrics.update({"tool_calls": 1})
    failed = AgentLoopOutput.failure([1, 2], "boom")
    failed.metrics["tool_calls"] = 50  # a failed sample's counters stay out of the means
    m = RolloutBatch.from_outputs([a, b, failed], prompt_length=4, response_length=3, pad_token_id=0).metrics
    assert m["agent_loop/tool_calls/mean"] == 2.0
    assert m["agent_loop/tool_calls/max"] == 3.0
    # b never called the tool: it counts 0 in the mean
    assert m["agent_loop/tool/calc/attempts/mean"] == 1.0
    assert m["agent_loop/tool/calc/attempts/max"] == 2.0
    assert not any(k.startswith("agent_loop/flag") or k.startswith("agent_loop/agent_name") for k in m)
    assert m["rollout/num_failed"] == 1


def test_widths_default_to_longest_and_pad_from_tokenizer():
    class Tok:
        pad_token_id = None
        eos_token_id = 99

    batch = RolloutBatch.from_outputs(two_outputs(), tokenizer=Tok())
    assert batch.prompts.shape == (2, 3)
    assert batch.responses.shape == (2, 3)
    assert batch.pad_token_id == 99
    assert batch.responses[1, 1] == 99
    with pytest.raises(ValueError, match="no pad token id"):
        RolloutBatch.from_outputs(two_outputs())


def test_failed_and_nan_rewards_become_zero_and_flagged():
    outs = two_outputs()
    outs[1] = AgentLoopOutput.failure(None, RuntimeError("boom"), sample_index=1)
    outs.append(
        AgentLoopOutput(
            prompt_ids=[3],
            response_ids=[3],
            response_mask=[1],
            response_logprobs=[-1.0],
            reward_score=math.nan,
        )
    )
    batch = RolloutBatch.from_outputs(outs, prompt_length=4, response_length=3, pad_token_id=0)
    np.testing.assert_array_equal(batch.failed, [False, True, False])
    np.testing.assert_array_equal(batch.rewards, [1.0, 0.0, 0.0])
    np.testing.assert_array_equal(batch.has_reward, [True, False, False])
    np.testing.assert_array_equal(batch.attention_mask[1], np.zeros(7))
    assert batch.metrics["rollout/num_failed"] == 1
    assert batch.num_failed == 1
    assert batch.sample_metrics[1]["error"] == "RuntimeError: boom"


def test_too_long_raises_by_default_and_truncate_flags(caplog):
    with pytest.raises(
        SequenceTooLongError, match=r"sample 0: .*3 tokens \(response_length=2\).*truncate=True"
    ):
        RolloutBatch.from_outputs(two_outputs(), prompt_length=4, response_length=2, pad_token_id=0)
    batch = RolloutBatch.from_outputs(
        two_outputs(), prompt_length=2, response_length=2, pad_token_id=0, truncate=True
    )
    np.testing.assert_array_equal(batch.truncated, [True, True])
    np.testing.assert_array_equal(batch.prompts, [[5, 6], [2, 3]])
    np.testing.assert_array_equal(batch.responses, [[7, 8], [4, 0]])
    np.testing.assert_array_equal(batch.response_mask, [[1, 0], [1, 0]])
    assert batch.metrics["rollout/num_truncated"] == 2
    assert "1 generated tokens dropped" in caplog.text


def test_logprobs_for_some_samples_only_is_an_error():
    outs = two_outputs()
    outs[1].response_logprobs = None
    with pytest.raises(ValueError, match=r"samples \[1\] have no response_logprobs"):
        RolloutBatch.from_outputs(outs, pad_token_id=0)
    for o in outs:
        o.response_logprobs = None
    assert RolloutBatch.from_outputs(outs, pad_token_id=0).rollout_log_probs is None


def test_to_torch():
    torch = pytest.importorskip("torch", reason="to_torch needs torch")
    tensors = RolloutBatch.from_outputs(two_outputs(), pad_token_id=0).to_torch()
    assert tensors["input_ids"].dtype == torch.int64
    assert tensors["rollout_log_probs"].dtype == torch.float32
    assert tensors["response_mask"].tolist() == [[1, 0, 1], [1, 0, 0]]


def test_importing_core_and_runtime_does_not_import_torch_ray_or_mlflow():
    code = (
        "import sys, agentloop_core, agentloop_core.batch, agentloop_core.runtime, agentloop_core.tracing.jsonl; "
        "bad = [m for m in ('torch', 'ray', 'mlflow') if m in sys.modules]; "
        "assert not bad, bad"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
