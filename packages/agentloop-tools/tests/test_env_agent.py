"""EnvAgentLoop ("env_agent") on a scripted engine with the tiny tokenizer: environments
written in the tests, found by name, run with exact tokens, limits and failure accounting.

The engine is scripted so each test controls what the "model" says; tokenization, the chat
template, the parsers and the loop are real.
"""

from __future__ import annotations

import itertools
import json
from typing import Any

import pytest

from agentloop_core.environment import (
    AssistantTurn,
    Environment,
    EnvironmentError,
    StepResult,
    UnknownEnvironmentError,
    get_environment_class,
    register_environment,
)
from agentloop_core.registry import get_agent_loop_class
from agentloop_core.runtime import AgentLoopManager
from agentloop_core.testing import ScriptedServer, load_tiny_tokenizer
from agentloop_tools.env_agent import EnvAgentLoop

PROMPT = [{"role": "user", "content": "Count to three, one number per turn."}]
SAMPLING = {"temperature": 0.0, "logprobs": True}
SEEN: list[AssistantTurn] = []
CLOSED: list[str] = []


@register_environment("test_counter")
class CounterEnv(Environment):
    """Wants 1, 2, 3 in order; 0.5 per right number, feedback after each turn. Records what it
    saw in SEEN and its close in CLOSED."""

    def __init__(self, target: int = 3, fail_on: int | None = None, junk: bool = False) -> None:
        self.target, self.fail_on, self.junk = target, fail_on, junk
        self.next = 1

    async def step(self, turn: AssistantTurn) -> StepResult:
        SEEN.append(turn)
        if self.fail_on == turn.index:
            raise RuntimeError("scoreboard on fire")
        if self.junk:
            return "not a result"  # type: ignore[return-value]
        right = turn.content.strip() == str(self.next)
        self.next += right
        done = self.next > self.target
        return StepResult([{"role": "user", "content": f"next is {self.next}" * (1 if right else 40)}],
                          0.5 if right else 0.0, done, {"right": int(right)})

    async def close(self) -> None:
        CLOSED.append("closed")


CALC = {"type": "function", "function": {"name": "add", "description": "Add two numbers.", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}


@register_environment("test_adder")
class AdderEnv(Environment):
    """A tool environment: answers ``add`` calls; a turn without calls ends it (reward 1 for "7")."""

    def tool_schemas(self) -> list[dict[str, Any]]:
        return [CALC]

    async def step(self, turn: AssistantTurn) -> StepResult:
        SEEN.append(turn)
        if not turn.tool_calls and not turn.tool_call_errors:
            return StepResult([], float(turn.content.strip() == "7"), True, {})
        out = [{"role": "tool", "name": c.name, "tool_call_id": i, "content": str(c.arguments["a"] + c.arguments["b"])}
               for c, i in zip(turn.tool_calls, turn.tool_call_ids, strict=True)]
        out += [{"role": "tool", "name": e.name or "", "tool_call_id": i, "content": "Error: " + e.reason}
                for e, i in zip(turn.tool_call_errors, turn.error_call_ids, strict=True)]
        return StepResult(out, 0.0, False, {})


@pytest.fixture(scope="module")
def tokenizer():
    return load_tiny_tokenizer()


@pytest.fixture(autouse=True)
def _clear():
    SEEN.clear()
    CLOSED.clear()


def scripted(tokenizer, turns: list[str]) -> ScriptedServer:
    def reply(request_id: str, prompt_ids: list[int], index: int) -> list[int]:
        return tokenizer.encode(turns[min(index, len(turns) - 1)], add_special_tokens=False)

    return ScriptedServer(reply, eos_token_id=tokenizer.eos_token_id, append_eos=True)


def loop(server, tokenizer, **config: Any) -> EnvAgentLoop:
    return EnvAgentLoop(server, tokenizer, {"response_length": 2048, **config})


def row(env: str = "test_counter", **kwargs: Any) -> dict[str, Any]:
    return {"raw_prompt": PROMPT, "request_id": "r1",
            "extra_info": {"environment": env, "environment_kwargs": kwargs}}


def test_registered_and_found_by_name():
    assert get_agent_loop_class("env_agent") is EnvAgentLoop
    assert get_environment_class("test_counter") is CounterEnv
    assert get_environment_class(f"{__name__}:AdderEnv") is AdderEnv
    with pytest.raises(UnknownEnvironmentError, match=r"unknown environment 'nope'.*test_counter.*agentloop.environments"):
        get_environment_class("nope")


async def test_three_steps_keep_exactly_the_engine_tokens_and_each_step_reward(tokenizer):
    server = scripted(tokenizer, ["1", "5", "2", "3"])
    out = await loop(server, tokenizer).run(SAMPLING, **row())

    assert len(server.calls) == 4
    generated = [t for c in server.calls for t in c.output.token_ids]
    logprobs = [lp for c in server.calls for lp in c.output.log_probs]
    assert [t for t, m in zip(out.response_ids, out.response_mask, strict=True) if m] == generated
    assert [lp for lp, m in zip(out.response_logprobs, out.response_mask, strict=True) if m] == logprobs
    for prev, nxt in itertools.pairwise(server.calls):
        assert nxt.prompt_ids[: len(prev.prompt_ids) + len(prev.output.token_ids)] == prev.prompt_ids + prev.output.token_ids
    assert out.prompt_ids + out.response_ids == server.calls[-1].prompt_ids + server.calls[-1].output.token_ids
    # The environment's feedback is in the trajectory as mask-0 tokens, between the turns.
    feedback = tokenizer.decode([t for t, m in zip(out.response_ids, out.response_mask, strict=True) if not m])
    assert "next is 2" in feedback
    assert "next is 3" in feedback
    assert out.extra_fields["step_rewards"] == [0.5, 0.0, 0.5, 0.5]
    assert out.extra_fields["turn_rewards"] == [0.5, 0.0, 0.5, 0.5]  # one per turn: the turn stepped
    assert out.reward_score == pytest.approx(1.5)
    assert out.extra_fields["termination_reason"] == "env_done"
    assert out.extra_fields["environment"] == "test_counter"
    assert out.metrics["env/right"] == 3
    assert out.metrics["env_steps"] == 4
    assert [t.index for t in SEEN] == [0, 1, 2, 3]
    assert [t.text for t in SEEN] == ["1", "5", "2", "3"]
    assert list(SEEN[0].token_ids) == list(server.calls[0].output.token_ids)
    assert CLOSED == ["closed"]


async def test_tool_calls_are_parsed_for_the_environment_and_answered_by_id(tokenizer):
    call = "<tool_call>\n" + json.dumps({"name": "add", "arguments": {"a": 3, "b": 4}}) + "\n</tool_call>"
    bad = "<tool_call>\n{not json}\n</tool_call>"
    server = scripted(tokenizer, [call + bad, "7"])
    out = await loop(server, tokenizer).run(SAMPLING, **row("test_adder"))

    assert "add" in tokenizer.decode(server.calls[0].prompt_ids)  # the env's schema is in the prompt
    first = SEEN[0]
    assert [(c.name, c.arguments) for c in first.tool_calls] == [("add", {"a": 3, "b": 4})]
    assert len(first.tool_call_errors) == 1
    assert len(first.error_call_ids) == 1
    tools = [m for m in out.extra_fields["messages"] if m["role"] == "tool"]
    assert [m["content"] for m in tools][0] == "7"
    assert [m["tool_call_id"] for m in tools] == [*first.tool_call_ids, *first.error_call_ids]
    assert out.reward_score == 1.0
    assert out.metrics["parse_errors"] == 1
    assert out.metrics["tool_calls"] == 1


async def test_reasoning_is_split_off_before_the_environment_reads_the_turn(tokenizer):
    server = scripted(tokenizer, ["<think>maybe 9</think>1", "<think>so</think>2", "<think>then</think>3"])
    out = await loop(server, tokenizer, reasoning_parser="deepseek_r1").run(SAMPLING, **row())
    assert SEEN[0].reasoning is not None
    assert "maybe 9" in SEEN[0].reasoning
    assert SEEN[0].content.strip() == "1"
    assert out.reward_score == pytest.approx(1.5)
    assert out.metrics["reasoning_turns"] == 3


async def test_limits_of_tool_agent_apply(tokenizer):
    # A wrong answer gets a 40-fold message: cut to max_tool_response_length like a tool result.
    server = scripted(tokenizer, ["9"])
    out = await loop(server, tokenizer, max_tool_response_length=30, max_assistant_turns=3).run(SAMPLING, **row())
    users = [m["content"] for m in out.extra_fields["messages"] if m["role"] == "user"][1:]
    assert users
    assert all(len(u) <= 30 + len("...(truncated)...") for u in users)
    assert out.metrics["tool_responses_truncated_length"] == 2
    assert len(server.calls) == 3
    assert len(SEEN) == 2
    assert out.extra_fields["termination_reason"] == "max_assistant_turns"
    # A turn cut by the per-turn cap is not stepped either.
    SEEN.clear()
    out = await loop(scripted(tokenizer, ["1 2 3 4 5 6 7 8"]), tokenizer).run({**SAMPLING, "max_tokens": 3}, **row())
    assert SEEN == []
    assert out.extra_fields["termination_reason"] == "length"
    assert out.reward_score == 0.0


async def test_a_failing_environment_fails_the_sample_and_is_closed(tokenizer):
    with pytest.raises(EnvironmentError, match=r"environment 'test_counter' step failed: RuntimeError: scoreboard"):
        await loop(scripted(tokenizer, ["1"]), tokenizer).run(SAMPLING, **row(fail_on=1))
    assert CLOSED == ["closed"]
    with pytest.raises(EnvironmentError, match=r"must return \(messages, reward, done, info\)"):
        await loop(scripted(tokenizer, ["1"]), tokenizer).run(SAMPLING, **row(junk=True))
    with pytest.raises(EnvironmentError, match=r"__init__ failed: TypeError"):
        await loop(scripted(tokenizer, ["1"]), tokenizer).run(SAMPLING, **row(colour="red"))
    with pytest.raises(ValueError, match=r"names no environment.*loops.env_agent.environment"):
        await loop(scripted(tokenizer, ["1"]), tokenizer).run(SAMPLING, raw_prompt=PROMPT)


def test_failed_environments_are_counted_in_the_batch(tokenizer):
    rows = [{**row(), "agent_name": "env_agent"}, {**row(fail_on=0), "agent_name": "env_agent"}]
    for i, r in enumerate(rows):
        r["request_id"] = f"r{i}"
    manager = AgentLoopManager(scripted(tokenizer, ["1", "2", "3"]), tokenizer,
                               {"default_agent_loop": "env_agent", "response_length": 256,
                                "sampling_params": {"max_tokens": 8}})
    try:
        batch = manager.generate_sequences(rows)
    finally:
        manager.shutdown()
    assert batch.failed.tolist() == [False, True]
    assert batch.metrics["rollout/num_failed"] == 1
    assert batch.rewards[0] == pytest.approx(1.5)


async def test_config_names_the_default_environment(tokenizer):
    server = scripted(tokenizer, ["1", "2"])
    config = {"environment": "test_counter", "environment_kwargs": {"target": 2}}
    out = await loop(server, tokenizer, **config).run(SAMPLING, raw_prompt=PROMPT)
    assert out.reward_score == pytest.approx(1.0)
    assert out.extra_fields["step_rewards"] == [0.5, 0.5]
