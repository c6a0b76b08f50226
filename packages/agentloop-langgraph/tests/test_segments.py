"""Graphs that rewrite their history (summaries, trimming, edited messages) become segments:
each call that does not extend the trajectory starts a new one, every mask-1 token stays the
engine's, in order, and the segments share one reward through the loop, the worker and the
batch. The engine is scripted; LangGraph, the tools, the template and the tokenizer are real."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage
from langgraph_helpers import generated, hermes_call, masked

from agentloop_core.output import AgentLoopOutput
from agentloop_core.runtime import AgentLoopManager
from agentloop_core.segments import trajectory_reward
from agentloop_core.testing import ScriptedServer
from agentloop_langgraph import METADATA_KEY, ChatModel, ReactAgentLoop
from agentloop_langgraph.examples import SUMMARY_NAME, summarising_agent
from agentloop_tools.base import BaseTool
from agentloop_tools.builtin import calculator
from agentloop_tools.builtin.calculator import evaluate_expression, format_number
from agentloop_tools.schema import ToolResponse

SUMMARISING = "agentloop_langgraph.examples.summarising_agent:summarising_agent"
PROMPT = [{"role": "user", "content": "What is (3 + 4) * 2?"}]
REPLIES = [hermes_call("calculator", expression="3 + 4"), hermes_call("calculator", expression="7 * 2"),
           "The answer is 14.\n#### 14"]
QUESTION = [SystemMessage("Use the calculator."), HumanMessage("What is 6 * 7?")]


class ScoredCalculator(BaseTool):
    """The calculator with a step reward of 0.25 per call and 1.0 from ``calc_reward``, so the
    trajectory's reward (1.5 for two calls) is one no single segment could make up alone."""

    def __init__(self) -> None:
        super().__init__({}, calculator.tool_schema.model_dump(exclude_none=True))

    async def execute(self, instance_id, parameters, **kwargs):
        value = evaluate_expression(parameters["expression"])
        return ToolResponse(text=format_number(value)), 0.25, {}

    async def calc_reward(self, instance_id, **kwargs):
        return 1.0


def per_request(tokenizer, replies: list[str]) -> ScriptedServer:
    """A scripted engine saying ``replies[i]`` on the i-th call of each request (rows run concurrently)."""
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    encoded = [tokenizer.encode(t, add_special_tokens=False) for t in replies]
    return ScriptedServer(lambda rid, prompt, i: encoded[min(i, len(encoded) - 1)], eos_token_id=eos,
                          append_eos=True)


async def run_loop(server, tokenizer, config: dict[str, Any], **row: Any):
    loop = ReactAgentLoop(server, tokenizer, {"tools": {"calculator": calculator}, **config})
    return await loop.run({"temperature": 0.0, "logprobs": True}, raw_prompt=PROMPT, **row)


def as_list(result) -> list[AgentLoopOutput]:
    return result if isinstance(result, list) else [result]


def assert_engine_tokens(segments: list[AgentLoopOutput], server) -> None:
    """Mask-1 tokens of the segments, in order, are the engine's ids and log-probs, and each
    segment's prompt is the prompt of the first call it holds."""
    assert [t for s in segments for t in masked(s)] == generated(server)
    logprobs = [lp for call in server.calls for lp in call.output.log_probs]
    assert [lp for s in segments for lp, m in zip(s.response_logprobs, s.response_mask, strict=True) if m] == logprobs
    prompts = [c.prompt_ids for c in server.calls]
    assert all(s.prompt_ids in prompts for s in segments)
    assert [s.segment_index for s in segments] == list(range(len(segments)))


# -- the summarising agent ----------------------------------------------------------------------


async def test_summarising_agent_yields_two_segments_of_engine_tokens(tokenizer, scripted):
    server = scripted(REPLIES)
    tool = ScoredCalculator()
    loop = ReactAgentLoop(server, tokenizer, {"tools": {"calculator": tool}, "graph_factory": SUMMARISING})
    result = await loop.run({"temperature": 0.0, "logprobs": True}, raw_prompt=PROMPT, request_id="traj-s")

    assert isinstance(result, list)
    assert len(result) == 2
    first, second = result
    assert len(server.calls) == 3
    assert {c.request_id for c in server.calls} == {"traj-s"}
    assert_engine_tokens(result, server)
    # Segment 0 holds the first two calls, extending each other; segment 1 starts at the third.
    c1, c2, c3 = server.calls
    assert first.prompt_ids == c1.prompt_ids
    assert second.prompt_ids == c3.prompt_ids
    assert masked(first) == c1.output.token_ids + c2.output.token_ids
    assert masked(second) == c3.output.token_ids
    assert first.prompt_ids + first.response_ids == c2.prompt_ids + c2.output.token_ids
    assert second.response_ids == c3.output.token_ids
    # The summary replaced turn 1; turn 2 (an AI message the engine generated) is prompt text now.
    text = tokenizer.decode(second.prompt_ids)
    assert "- you called calculator(expression='3 + 4'): 7" in text
    assert '"expression": "7 * 2"' in text
    assert "<tool_response>\n14\n</tool_response>" in text
    assert [m["role"] for m in second.extra_fields["messages"]] == ["user", "user", "assistant", "tool", "assistant"]
    assert "message 1" in second.extra_fields["segment_reason"]
    assert "segment_reason" not in first.extra_fields
    # One reward for the trajectory (2 x 0.25 step rewards + 1.0), on both segments.
    assert first.reward_score == second.reward_score == 1.5
    assert trajectory_reward(result) == 1.5
    for s in result:
        assert s.metrics["num_segments"] == 2
        assert s.metrics["assistant_turns"] == 3
        assert s.metrics["tool_calls"] == 2
        assert s.metrics.get("tokenization_mismatch", 0) == 0
        assert s.extra_fields["termination_reason"] == "graph_end"
    assert tool.live_instances == 0


async def test_summarising_agent_segments_reach_one_trajectory_of_the_rollout_batch(tokenizer):
    server = per_request(tokenizer, REPLIES)

    async def reward_fn(output, row, tok):
        output.reward_score = float("#### 14" in tok.decode(output.response_ids))

    config = {"default_agent_loop": "react_agent", "tools": {"calculator": calculator},
              "graph_factory": SUMMARISING, "sampling_params": {"temperature": 0.0, "logprobs": True},
              "prompt_length": 512, "response_length": 256, "reward_fn": reward_fn}
    manager = AgentLoopManager(server, tokenizer, config)
    rows = [{"raw_prompt": PROMPT, "request_id": f"row-{i}"} for i in range(2)]
    outputs = await manager.agenerate_outputs(rows)
    batch = await manager.agenerate_sequences([{**r, "request_id": f"again-{i}"} for i, r in enumerate(rows)])

    assert [(o.trajectory_index, o.segment_index) for o in outputs] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert [o.reward_score for o in outputs] == [1.0] * 4  # scored once, on the whole trajectory
    assert batch.trajectory_index.tolist() == [0, 0, 1, 1]
    assert batch.segment_index.tolist() == [0, 1, 0, 1]
    assert batch.num_trajectories == 2
    assert batch.num_failed == 0
    assert np.all(batch.rewards == 1.0)
    assert batch.metrics["agent_loop/num_segments/mean"] == 2.0
    # A trajectory's rows hold, in order, exactly the ids the engine generated for its request.
    for t in range(2):
        rows_of_t = np.flatnonzero(batch.trajectory_index == t)
        kept = [int(x) for r in rows_of_t for x in batch.responses[r][batch.response_mask[r] == 1]]
        assert kept == [x for c in server.calls if c.request_id == f"again-{t}" for x in c.output.token_ids]


async def test_summarising_agent_without_enough_turns_is_one_output(tokenizer, scripted):
    server = scripted(["Just 14."])
    out = await run_loop(server, tokenizer, {"graph_factory": SUMMARISING})
    assert isinstance(out, AgentLoopOutput)
    assert not out.failed
    assert out.metrics["num_segments"] == 1
    assert masked(out) == generated(server)


async def test_nudged_summarising_agent_keeps_summarising_until_the_turn_limit(tokenizer, scripted):
    # A model that never calls a tool, nudged to go on: summaries after turns 2, 3 and 4.
    server = scripted(["Maybe 13.", "Maybe 14.", "Surely 14.", "14.", "unused"])
    out = await run_loop(server, tokenizer, {
        "graph_factory": SUMMARISING, "max_assistant_turns": 4,
        "graph_factory_kwargs": {"nudge": "Check again.", "summarise_after": 2, "keep_last_turns": 1}})
    segments = as_list(out)
    assert len(server.calls) == 4
    assert len(segments) == 3
    assert_engine_tokens(segments, server)
    assert [len(s.extra_fields["messages"]) for s in segments] == [4, 5, 5]  # Q, (A, nudge) x k, ...
    last = tokenizer.decode(segments[-1].prompt_ids)
    # A second summary carries the first one's lines on.
    assert "- you answered: Maybe 13." in last
    assert "- you answered: Maybe 14." in last
    assert all(s.extra_fields["termination_reason"] == "max_assistant_turns" for s in segments)


def test_summarising_agent_rejects_bad_settings():
    with pytest.raises(ValueError, match="keep_last_turns=2 must be below summarise_after=2"):
        summarising_agent(None, [], summarise_after=2, keep_last_turns=2)
    with pytest.raises(ValueError, match="summarise_after must be an integer >= 1"):
        summarising_agent(None, [], summarise_after=0)


# -- ChatModel: segments by default, errors on request -------------------------------------------


def model_for(server, tokenizer, **kw) -> ChatModel:
    return ChatModel(server=server, tokenizer=tokenizer, sampling_params={"temperature": 0.0, "logprobs": True},
                     **kw)


@pytest.mark.parametrize("rewrite", ["edited_prompt", "foreign_ai_message", "fake_turn", "trimmed", "tools_changed"])
async def test_every_kind_of_rewrite_starts_a_new_segment(tokenizer, scripted, rewrite):
    server = scripted(["one", "two"])
    chat = model_for(server, tokenizer)
    first = await chat.ainvoke(QUESTION)
    history = {
        "edited_prompt": [QUESTION[0], HumanMessage("What is 6 * 8?"), first, HumanMessage("and?")],
        "foreign_ai_message": [*QUESTION, first, HumanMessage("x"), AIMessage("I wrote this"), HumanMessage("y")],
        "fake_turn": [*QUESTION, AIMessage("one"), HumanMessage("and?")],
        "trimmed": [QUESTION[1], first, HumanMessage("and?")],
        "tools_changed": [*QUESTION, first, HumanMessage("and?")],
    }[rewrite]
    model = chat.bind_tools([calculator.tool_schema.model_dump(exclude_none=True)]) \
        if rewrite == "tools_changed" else chat
    second = await model.ainvoke(history)

    session = chat.session()
    assert len(session.segments) == 2
    assert len(session.rewrites) == 1
    assert second.response_metadata[METADATA_KEY]["turn"] == 2  # turns count over the whole trajectory
    first_seg, second_seg = session.segments
    assert first_seg.response_ids == server.calls[0].output.token_ids
    assert second_seg.prompt_ids == server.calls[1].prompt_ids
    assert second_seg.response_ids == server.calls[1].output.token_ids
    assert second_seg.messages[-2]["role"] == "user"
    for seg in session.segments:  # each segment passes the sanity check on its own
        assert seg.sanity_check().ok


async def test_a_new_segment_keeps_extending_and_can_be_rewritten_again(tokenizer, scripted):
    server = scripted(["one", "two", "three", "four"])
    chat = model_for(server, tokenizer)
    a = await chat.ainvoke(QUESTION)
    summary = HumanMessage("Summary: you said one.")
    b = await chat.ainvoke([*QUESTION[:1], summary, HumanMessage("go on")])
    c = await chat.ainvoke([*QUESTION[:1], summary, HumanMessage("go on"), b, HumanMessage("more")])
    # Back to the first context: the generated message a is prompt text of a third segment.
    await chat.ainvoke([*QUESTION, a, HumanMessage("and?")])

    session = chat.session()
    assert [t.num_generations for t in session.segments] == [1, 2, 1]
    assert session.num_generations == 4
    assert c.response_metadata[METADATA_KEY]["turn"] == 3
    assert [t for seg in session.segments for t, m in zip(seg.response_ids, seg.response_mask, strict=True) if m] \
        == [t for call in server.calls for t in call.output.token_ids]
    assert server.calls[3].prompt_ids[: len(session.segments[0].prompt_ids)] == session.segments[0].prompt_ids


async def test_a_call_ending_in_an_ai_message_is_still_an_error(tokenizer, scripted):
    chat = model_for(scripted(["one"]), tokenizer)
    first = await chat.ainvoke(QUESTION)
    with pytest.raises(ValueError, match="last input message is an AI message"):
        await chat.ainvoke([*QUESTION, first])
    assert len(chat.session().segments) == 1


# -- the loop: defaults, limits and the strict option --------------------------------------------


async def test_trimming_graph_trains_as_segments_by_default(tokenizer, scripted):
    server = scripted(REPLIES)
    segments = as_list(await run_loop(server, tokenizer, {"graph_factory": "langgraph_helpers:trimming_graph"}))
    # Every call after the first shows the model [first, last] message: a new segment each time.
    assert len(segments) == len(server.calls) == 3
    assert_engine_tokens(segments, server)
    assert [s.prompt_ids for s in segments] == [c.prompt_ids for c in server.calls]
    assert all(not s.failed and s.metrics["num_segments"] == 3 for s in segments)
    assert calculator.live_instances == 0


async def test_on_history_rewrite_error_reaches_the_chat_model(tokenizer, scripted):
    loop = ReactAgentLoop(scripted([]), tokenizer, {"on_history_rewrite": "error"})
    assert loop.chat_model({}, "r").on_history_rewrite == "error"
    assert ReactAgentLoop(scripted([]), tokenizer, {}).chat_model({}, "r").on_history_rewrite == "segment"


async def test_max_assistant_turns_counts_turns_over_all_segments(tokenizer, scripted):
    server = scripted(REPLIES)
    out = await run_loop(server, tokenizer, {"graph_factory": "langgraph_helpers:trimming_graph",
                                             "max_assistant_turns": 2})
    segments = as_list(out)
    assert len(server.calls) == 2
    assert len(segments) == 2
    assert all(s.extra_fields["termination_reason"] == "max_assistant_turns" for s in segments)


async def test_response_length_is_a_budget_per_segment(tokenizer, scripted):
    # Each segment is one training row of width response_length: a budget that one segment's
    # two calls overflow fits each of the trimming graph's one-call segments.
    server = scripted(REPLIES)
    n = [len(tokenizer.encode(r, add_special_tokens=False)) + 1 for r in REPLIES]
    budget = max(n) + 2
    segments = as_list(await run_loop(server, tokenizer, {"graph_factory": "langgraph_helpers:trimming_graph",
                                                          "response_length": budget}))
    assert len(segments) == 3
    assert all(len(s.response_ids) <= budget for s in segments)
    assert segments[-1].extra_fields["termination_reason"] == "graph_end"
    one_sequence = await run_loop(scripted(REPLIES), tokenizer, {"response_length": budget})
    assert one_sequence.extra_fields["termination_reason"] == "response_length"


async def test_a_segment_prompt_over_prompt_length_ends_the_episode(tokenizer, scripted):
    server = scripted(REPLIES)
    first_prompt = len(ChatModel(server=server, tokenizer=tokenizer)._renderer(
        [calculator.tool_schema.model_dump(exclude_none=True)], "k").render_prompt(PROMPT))
    # The summary prompt is longer than the question's: it ends the episode instead of failing it.
    out = await run_loop(server, tokenizer, {"graph_factory": SUMMARISING, "prompt_length": first_prompt + 5})
    assert isinstance(out, AgentLoopOutput)
    assert not out.failed
    assert out.extra_fields["termination_reason"] == "prompt_length"
    assert len(server.calls) == 2
    assert masked(out) == generated(server)


async def test_every_segment_is_sanity_checked(tokenizer, scripted, monkeypatch):
    from agentloop_core.tokenization import TokenizationMismatchError, Trajectory
    from agentloop_core.tokenization.sanity import SanityCheckReport

    original = Trajectory.sanity_check
    checked: list[int] = []

    def spy(self, mode="strict"):
        checked.append(len(self.prompt_ids))
        if len(checked) == 1:  # the first segment's check fails
            return SanityCheckReport(ok=False, mode=mode, reason="planted mismatch")
        return original(self, mode)

    monkeypatch.setattr(Trajectory, "sanity_check", spy)
    with pytest.raises(TokenizationMismatchError, match="planted mismatch"):
        await run_loop(scripted(REPLIES), tokenizer, {"graph_factory": SUMMARISING})
    checked.clear()
    segments = await run_loop(scripted(REPLIES), tokenizer, {"graph_factory": SUMMARISING,
                                                             "sanity_check": "ignore_strippable"})
    assert len(checked) == 2
    # A flag of any segment is the trajectory's (the batch reads per-trajectory metrics from the last).
    assert all(s.metrics["tokenization_mismatch"] == 1 for s in segments)


def test_summary_messages_are_marked():
    from agentloop_langgraph.examples.summarising_agent import is_summary, summary_message

    msg = summary_message([AIMessage("", tool_calls=[{"name": "calculator", "args": {"expression": "1+1"},
                                                       "id": "c1"}])])
    assert is_summary(msg)
    assert msg.name == SUMMARY_NAME
    assert "- you called calculator(expression='1+1'): no result" in msg.content
