"""Rewards that misbehave (hostile-input issue #45, class 3): a reward that is finite in float64
but not in float32 (the dtype advantages are computed in), NaN, a reward function that never
returns (sync and async), an environment whose ``reset`` / ``step`` never returns, a tool's ``calc_reward`` or an
interaction that never returns.

Each must fail its own sample, with the reason and the key to change, and leave the rest of
the batch (and of its group's advantages) intact. Before: the 1e39 reward made its group's
advantages NaN (or, built into a batch under ``filterwarnings=error``, raised numpy's overflow
warning), and the hangs held the batch forever (the ``wait_for`` guards below turn that into a
failure instead of a stuck test run).
"""

from __future__ import annotations

import asyncio
import textwrap
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pytest
import torch

from agentloop_core import AgentLoopManager
from agentloop_core.batch import RolloutBatch
from agentloop_core.environment import AssistantTurn, Environment, StepResult, register_environment
from agentloop_core.output import AgentLoopOutput
from agentloop_core.testing import ScriptedServer
from agentloop_tools.base import BaseTool
from agentloop_tools.env_agent import EnvAgentConfig
from agentloop_tools.interaction import BaseInteraction
from agentloop_tools.loop_config import ToolAgentConfig
from agentloop_tools.schema import ToolResponse
from agentloop_trainer.reward.scoring import RewardScorer
from agentloop_trainer.update.advantages import compute_advantages
from agentloop_trainer.update.turn_credit import CreditSettings, credit_advantages

REWARD_FILE = textwrap.dedent('''
    """Scores a row by its ground truth: a number, 'big' (1e39), 'nan', or 'hang' (never returns)."""
    import asyncio
    import threading

    RELEASE = threading.Event()

    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        if ground_truth == "big":
            return 1e39
        if ground_truth == "nan":
            return float("nan")
        if ground_truth == "hang":
            RELEASE.wait()  # a sync scorer stuck on I/O that never answers
        return float(ground_truth)

    async def compute_score_async(data_source, solution_str, ground_truth, extra_info=None):
        if ground_truth == "hang":
            await asyncio.Event().wait()
        return compute_score(data_source, solution_str, ground_truth, extra_info)
''')


def _engine(tokenizer: Any) -> ScriptedServer:
    def reply(request_id: str, prompt_ids: list[int], index: int) -> list[int]:
        return tokenizer.encode("#### 1", add_special_tokens=False)

    return ScriptedServer(reply, eos_token_id=tokenizer.eos_token_id, append_eos=True)


def _rows(truths: Sequence[str], groups: Sequence[int]) -> list[dict[str, Any]]:
    return [{"raw_prompt": [{"role": "user", "content": "Say 1."}], "request_id": f"g{g}-{i}", "data_source": "test",
             "reward_model": {"ground_truth": t}} for i, (t, g) in enumerate(zip(truths, groups, strict=True))]


def _manager(tokenizer: Any, scorer: Any, **config: Any) -> AgentLoopManager:
    return AgentLoopManager(_engine(tokenizer), tokenizer, {
        "default_agent_loop": "single_turn_agent", "response_length": 64, "sampling_params": {"max_tokens": 8},
        "reward_fn": scorer, **config})


def _scorer(tmp_path: Any, **kw: Any) -> RewardScorer:
    path = tmp_path / "reward.py"
    path.write_text(REWARD_FILE)
    return RewardScorer(source="function", path=str(path), **kw)


def test_overflowing_and_nan_rewards_fail_their_sample_and_the_group_keeps_finite_advantages(tokenizer, tmp_path):
    truths = ["1", "0", "big", "1", "0", "1", "nan", "0.5"]
    groups = [0, 0, 0, 0, 1, 1, 1, 1]
    manager = _manager(tokenizer, _scorer(tmp_path))
    try:
        batch = manager.generate_sequences(_rows(truths, groups))
    finally:
        manager.shutdown()
    assert batch.failed.tolist() == [False, False, True, False, False, False, True, False]
    assert batch.metrics["rollout/num_failed"] == 2
    errors = [m.get("error", "") for m in batch.sample_metrics]
    assert "RewardNotFiniteError: reward 1e+39 is not finite as float32" in errors[2], errors[2]
    assert "not finite" in errors[6] or "finite number" in errors[6], errors[6]
    advantages = credit_advantages(CreditSettings(), batch, groups)
    assert torch.isfinite(advantages).all(), advantages
    # The documented rule for a failed sample: reward 0 in its group's baseline, its tokens out of the loss.
    expected = compute_advantages("grpo", [1.0, 0.0, 0.0, 1.0, 0.0, 1.0, 0.0, 0.5], groups)
    torch.testing.assert_close(advantages, expected)


def _out(reward: float, traj: int, turn_rewards: list[float] | None = None) -> AgentLoopOutput:
    extra = {} if turn_rewards is None else {"turn_rewards": turn_rewards}
    return AgentLoopOutput([1, 2], [10, 11, 50, 12], [1, 1, 0, 1], reward_score=reward, extra_fields=extra,
                           trajectory_index=traj, segment_index=0)


@pytest.mark.parametrize("mode", ["trajectory", "turn_group", "discounted"])
def test_non_finite_rewards_that_reach_the_batch_are_failed_before_advantages(mode):
    """What a loop's own reward or a hand-built batch can carry past the reward hook: inf and NaN
    rewards, and per-turn rewards of 1e39 and -1e39 (a finite sum, infinite returns in float32)."""
    outputs = [_out(1.0, 0, [0.0, 1.0]), _out(0.0, 1), _out(0.0, 2, [1e39, -1e39]), _out(1.0, 3),
               _out(0.0, 4), _out(1.0, 5), _out(0.0, 6), _out(0.5, 7)]
    batch = RolloutBatch.from_outputs(outputs, pad_token_id=0)
    batch.rewards[1] = np.inf
    batch.rewards[6] = np.nan
    groups = [0, 0, 0, 0, 1, 1, 1, 1]
    advantages = credit_advantages(CreditSettings(mode=mode), batch, groups)
    assert torch.isfinite(advantages).all(), advantages
    assert batch.failed.tolist() == [False, True, True, False, False, False, True, False]
    assert [m.get("reward_not_finite") for m in batch.sample_metrics] == [None, 1.0, 1.0, None, None, None, 1.0, None]
    assert "per-turn reward 1e+39 (turn 0)" in batch.sample_metrics[2]["error"]
    expected = credit_advantages(CreditSettings(mode=mode), RolloutBatch.from_outputs(
        [_out(1.0, 0, [0.0, 1.0]), AgentLoopOutput.failure([1, 2], "x", trajectory_index=1),
         AgentLoopOutput.failure([1, 2], "x", trajectory_index=2), _out(1.0, 3), _out(0.0, 4), _out(1.0, 5),
         AgentLoopOutput.failure([1, 2], "x", trajectory_index=6), _out(0.5, 7)], pad_token_id=0), groups)
    # The rows that did not fail get what they get when those samples failed in the rollout.
    keep = ~batch.failed
    torch.testing.assert_close(advantages[torch.from_numpy(keep)], expected[torch.from_numpy(keep)])


@pytest.mark.parametrize("name", ["compute_score", "compute_score_async"])
async def test_reward_function_that_never_returns_fails_its_sample_within_the_limit(tokenizer, tmp_path, name):
    assert RewardScorer().timeout_s == 300.0  # the default is a limit, not forever
    scorer = _scorer(tmp_path, name=name, timeout_s=0.5)
    manager = _manager(tokenizer, scorer)
    try:
        # wait_for only turns a hang into a failure; the checks below are on what happened.
        outputs = await asyncio.wait_for(manager.agenerate_outputs(_rows(["1", "hang", "0", "1"], [0] * 4)), 60)
    finally:
        manager.shutdown()
        if scorer._fn is not None:  # let the abandoned sync call's thread end
            scorer._fn.__globals__["RELEASE"].set()
    assert [o.failed for o in outputs] == [False, True, False, False]
    assert [o.reward_score for o in outputs] == [1.0, 0.0, 0.0, 1.0]
    assert outputs[1].metrics["reward_timeout"] == 1.0
    error = outputs[1].metrics["error"]
    assert error.startswith("RewardTimeoutError: reward function "), error
    assert "reward.timeout_s=0.5" in error, error


@register_environment("test_hanging_env")
class HangingEnv(Environment):
    """Answers each turn with "ok" and reward 1, ends after one step; ``hang`` names the method
    (``reset`` or ``step``) that never returns."""

    def __init__(self, hang: str | None = None) -> None:
        self.hang = hang

    async def reset(self, row: Mapping[str, Any]) -> Sequence[Mapping[str, Any]]:
        if self.hang == "reset":
            await asyncio.Event().wait()
        return await super().reset(row)

    async def step(self, turn: AssistantTurn) -> StepResult:
        if self.hang == "step":
            await asyncio.Event().wait()
        return StepResult([], 1.0, True, {})


@pytest.mark.parametrize("method", ["reset", "step"])
async def test_environment_call_that_never_returns_fails_its_sample_within_the_limit(tokenizer, method):
    assert EnvAgentConfig().env_timeout_s == 300.0  # the default is a limit, not forever
    rows = [{"raw_prompt": [{"role": "user", "content": "Say 1."}], "request_id": f"r{i}",
             "extra_info": {"environment": "test_hanging_env", "environment_kwargs": {"hang": hang}}}
            for i, hang in enumerate([None, method, None])]
    manager = AgentLoopManager(_engine(tokenizer), tokenizer, {
        "default_agent_loop": "env_agent", "response_length": 64, "sampling_params": {"max_tokens": 8},
        "env_timeout_s": 0.5})
    try:
        outputs = await asyncio.wait_for(manager.agenerate_outputs(rows), 60)
    finally:
        manager.shutdown()
    assert [o.failed for o in outputs] == [False, True, False]
    assert [o.reward_score for o in outputs if not o.failed] == [1.0, 1.0]
    error = outputs[1].metrics["error"]
    assert f"environment 'test_hanging_env' {method} ran longer than env_timeout_s=0.5 s" in error, error
    assert "loops.env_agent.env_timeout_s" in error


class HangingScoreTool(BaseTool):
    """A tool the model never calls whose ``calc_reward`` never returns for a row that says so."""

    def __init__(self) -> None:
        super().__init__({}, {"type": "function", "function": {"name": "noop", "description": "does nothing",
                                                                "parameters": {"type": "object", "properties": {}}}})

    async def init_state(self, hang: bool = False, **create_kwargs: Any) -> dict[str, Any]:
        return {"hang": hang}

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs: Any) -> Any:
        return ToolResponse(text="ok"), 0.0, {}

    async def calc_reward(self, instance_id: str) -> float:
        if self.state(instance_id)["hang"]:
            await asyncio.Event().wait()
        return 1.0


class HangingInteraction(BaseInteraction):
    """Ends the conversation with score 1, or never answers for a row that says so."""

    async def generate_response(self, instance_id: str, messages: list[dict[str, Any]],
                                **kwargs: Any) -> tuple[bool, str, float, dict[str, Any]]:
        if self.state(instance_id).get("hang"):
            await asyncio.Event().wait()
        return True, "thanks", 1.0, {}


@pytest.mark.parametrize("hook", ["calc_reward", "generate_response"])
async def test_tool_loop_scoring_call_that_never_returns_fails_its_sample_within_the_limit(tokenizer, hook):
    assert ToolAgentConfig().scoring_timeout_s == 300.0  # the default is a limit, not forever
    rows = [{"raw_prompt": [{"role": "user", "content": "Say 1."}], "request_id": f"r{i}",
             "tools_kwargs": {"noop": {"create_kwargs": {"hang": hang and hook == "calc_reward"}}},
             "interaction_kwargs": {"hang": hang and hook == "generate_response"}}
            for i, hang in enumerate([False, True, False])]
    manager = AgentLoopManager(_engine(tokenizer), tokenizer, {
        "default_agent_loop": "tool_agent", "response_length": 64, "sampling_params": {"max_tokens": 8},
        "tools": {"noop": HangingScoreTool()}, "interaction": HangingInteraction(), "scoring_timeout_s": 0.5})
    try:
        outputs = await asyncio.wait_for(manager.agenerate_outputs(rows), 60)
    finally:
        manager.shutdown()
    assert [o.failed for o in outputs] == [False, True, False]
    assert [o.reward_score for o in outputs if not o.failed] == [1.0, 1.0]  # calc_reward's
    error = outputs[1].metrics["error"]
    what = "tool 'noop' calc_reward" if hook == "calc_reward" else "interaction generate_response"
    assert f"CallTimeoutError: {what} ran longer than scoring_timeout_s=0.5 s" in error, error
    assert "loops.tool_agent.scoring_timeout_s" in error
