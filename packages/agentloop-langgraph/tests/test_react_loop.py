"""The ``react_agent`` loop running real LangGraph graphs (create_agent, create_react_agent and
hand-built StateGraphs) with real tools and the tiny tokenizer; the engine is scripted so each
test controls what the "model" says (see test_hf.py for real engine turns)."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
from langgraph_helpers import generated, hermes_call, masked

from agentloop_core.registry import get_agent_loop_class
from agentloop_langgraph import ReactAgentConfig, ReactAgentLoop
from agentloop_tools.agent_loop import ToolAgentLoop
from agentloop_tools.base import BaseTool, ToolKwargsError
from agentloop_tools.builtin import calculator
from agentloop_tools.loop_config import check_loop_config_keys
from agentloop_tools.schema import ToolResponse

PROMPT = [{"role": "user", "content": "What is (3 + 4) * 2?"}]
REPLIES = [hermes_call("calculator", expression="3 + 4"), hermes_call("calculator", expression="7 * 2"),
           "The answer is 14.\n#### 14"]


class BrokenTool(BaseTool):
    """Raises on every call, or (``fail_create``) already when a trajectory starts."""

    def __init__(self, fail_create: bool = False) -> None:
        super().__init__({}, {"type": "function", "function": {
            "name": "broken_create" if fail_create else "broken", "description": "always fails",
            "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}}})
        self.fail_create = fail_create

    async def init_state(self, **kwargs: Any):
        if self.fail_create:
            raise RuntimeError("no sandbox available")
        return {}

    async def execute(self, instance_id, parameters):
        raise RuntimeError(f"boom {parameters['x']}")


async def run_loop(server, tokenizer, config: dict[str, Any], prompt=PROMPT, **row: Any):
    loop = ReactAgentLoop(server, tokenizer, {"tools": {"calculator": calculator}, **config})
    return await loop.run({"temperature": 0.0, "logprobs": True}, raw_prompt=prompt, **row)


def test_react_agent_is_registered_by_entry_point():
    assert get_agent_loop_class("react_agent") is ReactAgentLoop


async def test_mask1_tokens_are_exactly_what_the_engine_generated(tokenizer, scripted):
    server = scripted(REPLIES)
    out = await run_loop(server, tokenizer, {}, request_id="traj-1")

    assert not out.failed, out.metrics
    assert len(server.calls) == 3
    assert masked(out) == generated(server)
    logprobs = [lp for call in server.calls for lp in call.output.log_probs]
    assert [lp for lp, m in zip(out.response_logprobs, out.response_mask, strict=True) if m] == logprobs
    assert all(lp == 0.0 for lp, m in zip(out.response_logprobs, out.response_mask, strict=True) if not m)
    # Each turn's prompt is the previous context verbatim: nothing was re-encoded.
    for before, after in zip(server.calls, server.calls[1:], strict=False):
        assert after.prompt_ids[: len(before.prompt_ids) + len(before.output.token_ids)] == \
            before.prompt_ids + before.output.token_ids
    assert out.prompt_ids == server.calls[0].prompt_ids
    assert {call.request_id for call in server.calls} == {"traj-1"}
    tool_texts = [m["content"] for m in out.extra_fields["messages"] if m["role"] == "tool"]
    assert tool_texts == ["7", "14"]
    assert out.metrics["tool_calls"] == 2
    assert out.metrics["tool_errors"] == 0
    assert out.metrics["assistant_turns"] == 3
    assert out.metrics.get("tokenization_mismatch", 0) == 0
    assert out.extra_fields["termination_reason"] == "graph_end"
    assert calculator.live_instances == 0


async def test_ids_match_the_tool_agent_loop_for_the_same_conversation(tokenizer, scripted):
    graph_server, tool_server = scripted(REPLIES), scripted(REPLIES)
    graph_out = await run_loop(graph_server, tokenizer, {})
    tool_loop = ToolAgentLoop(tool_server, tokenizer, {"tools": {"calculator": calculator}})
    tool_out = await tool_loop.run({"temperature": 0.0, "logprobs": True}, raw_prompt=PROMPT)

    assert [c.prompt_ids for c in graph_server.calls] == [c.prompt_ids for c in tool_server.calls]
    assert graph_out.prompt_ids == tool_out.prompt_ids
    assert graph_out.response_ids == tool_out.response_ids
    assert graph_out.response_mask == tool_out.response_mask
    assert graph_out.response_logprobs == tool_out.response_logprobs
    assert graph_out.extra_fields["messages"] == tool_out.extra_fields["messages"]


async def test_tool_errors_reach_the_graph_as_tool_messages(tokenizer, scripted):
    tools = {"calculator": calculator, "broken": BrokenTool(), "broken_create": BrokenTool(fail_create=True)}
    server = scripted([
        hermes_call("calculator", expression="1 / 0") + "\n" + hermes_call("broken", x=3)
        + "\n" + hermes_call("broken_create", x=1),
        "I could not compute it.",
    ])
    loop = ReactAgentLoop(server, tokenizer, {"tools": tools})
    out = await loop.run({"temperature": 0.0}, raw_prompt=PROMPT)

    assert not out.failed, out.metrics
    tool_texts = [m["content"] for m in out.extra_fields["messages"] if m["role"] == "tool"]
    assert tool_texts == [
        "Error: tool 'calculator' failed: CalculatorError: division by zero",
        "Error: tool 'broken' failed: RuntimeError: boom 3",
        "Error: tool 'broken_create' is unavailable (RuntimeError: no sandbox available).",
    ]
    assert out.metrics["tool_calls"] == 3
    assert out.metrics["tool_errors"] == 3
    assert len(server.calls) == 2  # the graph went on to the next model turn
    assert masked(out) == generated(server)
    assert calculator.live_instances == 0
    assert tools["broken"].live_instances == 0


async def test_graph_that_trims_history_fails_the_sample_with_on_history_rewrite_error(tokenizer, scripted):
    server = scripted(REPLIES)
    # An import path, as a config file would give it.
    out = await run_loop(server, tokenizer, {"graph_factory": "langgraph_helpers:trimming_graph",
                                             "on_history_rewrite": "error"})

    assert out.failed
    assert out.metrics["history_rewritten"] == 1
    assert "HistoryRewrittenError" in out.metrics["error"]
    assert "message 1" in out.metrics["error"]
    assert out.response_ids == []
    assert out.prompt_ids == server.calls[0].prompt_ids
    assert len(server.calls) == 1  # detected on the second model call, before it generated
    assert calculator.live_instances == 0


async def test_graph_that_edits_a_generated_message_is_detected_with_on_history_rewrite_error(tokenizer, scripted):
    from langchain.agents import create_agent
    from langchain.agents.middleware import before_model

    @before_model
    def tamper(state, runtime):
        from langchain_core.messages import AIMessage

        for m in state["messages"]:
            if isinstance(m, AIMessage) and "summarised" not in m.content:
                # Same id, so add_messages replaces the message in place.
                return {"messages": [m.model_copy(update={"content": "(summarised)"})]}
        return None

    def factory(chat_model, tools):
        return create_agent(chat_model, tools, middleware=[tamper])

    out = await run_loop(scripted(REPLIES), tokenizer, {"graph_factory": factory, "on_history_rewrite": "error"})
    assert out.failed
    assert out.metrics["history_rewritten"] == 1
    assert "were edited" in out.metrics["error"]


async def test_create_react_agent_graph_also_works(tokenizer, scripted):
    from langgraph.prebuilt import create_react_agent

    def factory(chat_model, tools):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # deprecated in favour of langchain's create_agent
            return create_react_agent(chat_model, tools)

    server = scripted(REPLIES)
    out = await run_loop(server, tokenizer, {"graph_factory": factory})
    assert not out.failed
    assert masked(out) == generated(server)
    assert len(server.calls) == 3


async def test_response_length_ends_the_episode_cleanly(tokenizer, scripted):
    server = scripted(REPLIES)
    first_len = len(tokenizer.encode(REPLIES[0], add_special_tokens=False)) + 1
    out = await run_loop(server, tokenizer, {"response_length": first_len + 5})

    assert not out.failed
    assert out.extra_fields["termination_reason"] == "response_length"
    assert len(server.calls) == 1  # the tool result did not fit, so it was not appended
    assert out.response_ids == generated(server)
    assert out.response_mask == [1] * first_len


async def test_max_assistant_turns(tokenizer, scripted):
    server = scripted(REPLIES)
    out = await run_loop(server, tokenizer, {"max_assistant_turns": 2})
    assert out.extra_fields["termination_reason"] == "max_assistant_turns"
    assert len(server.calls) == 2
    assert masked(out) == generated(server)
    assert out.response_mask[-1] == 0  # the second tool result sits after the last turn


async def test_system_prompt_of_the_default_agent_is_rendered(tokenizer, scripted):
    server = scripted(["Just 14."])
    out = await run_loop(server, tokenizer, {"system_prompt": "You are a careful calculator user."})
    assert out.extra_fields["messages"][0] == {"role": "system", "content": "You are a careful calculator user."}
    assert "You are a careful calculator user." in tokenizer.decode(out.prompt_ids)


@pytest.mark.parametrize(("config", "message"), [
    ({"graph_factory": "no_colon"}, "package.module:function"),
    ({"graph_factory": "no_such_module_xyz:f"}, "cannot import module"),
    ({"graph_factory": "langgraph_helpers:nope"}, "has no attribute"),
    ({"response_length": 0}, "response_length must be a positive integer"),
    ({"sanity_check": "loose"}, "sanity_check must be one of"),
    ({"on_history_rewrite": "ignore"}, "on_history_rewrite must be one of"),
])
def test_bad_config_is_a_clear_error(tokenizer, config, message):
    with pytest.raises(ValueError, match=message):
        ReactAgentLoop(object(), tokenizer, config)


async def test_bad_rows_are_clear_errors(tokenizer, scripted):
    loop = ReactAgentLoop(scripted([]), tokenizer, {"tools": {"calculator": calculator}})
    with pytest.raises(ValueError, match="raw_prompt"):
        await loop.run({}, raw_prompt="hello")
    with pytest.raises(ValueError, match="does not have"):
        await loop.run({}, raw_prompt=PROMPT, tools_kwargs={"search": {}})


async def test_factory_that_returns_no_graph_is_a_clear_error(tokenizer, scripted):
    with pytest.raises(ValueError, match="not a compiled graph"):
        await run_loop(scripted([]), tokenizer, {"graph_factory": lambda model, tools: object()})
    assert calculator.live_instances == 0


class RecordingTool(BaseTool):
    """Records what every lifecycle stage receives from the row (verl-style ``**kwargs``)."""

    def __init__(self) -> None:
        super().__init__({}, {"type": "function", "function": {
            "name": "record", "description": "echoes text",
            "parameters": {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}}})
        self.seen: list[tuple[str, Any]] = []

    async def init_state(self, **create_kwargs: Any):
        self.seen.append(("create", create_kwargs))
        return {}

    async def execute(self, instance_id, parameters, **kwargs):
        self.seen.append(("execute", kwargs))
        return ToolResponse(text=parameters["text"]), 0.0, {}

    async def calc_reward(self, instance_id, **kwargs):
        self.seen.append(("calc_reward", kwargs))
        return 0.5

    async def release(self, instance_id, **kwargs):
        self.seen.append(("release", kwargs))
        await super().release(instance_id)


async def test_every_tools_kwargs_part_reaches_its_stage(tokenizer, scripted):
    tool = RecordingTool()
    server = scripted([hermes_call("record", text="a") + "\n" + hermes_call("record", text="b"), "done"])
    loop = ReactAgentLoop(server, tokenizer, {"tools": {"record": tool}})
    out = await loop.run({"temperature": 0.0}, raw_prompt=PROMPT, tools_kwargs={"record": {
        "create_kwargs": {"seed": 1}, "execute_kwargs": {"mode": "fast"},
        "calc_reward_kwargs": {"ground_truth": "7"}, "release_kwargs": {"keep": False}}})
    assert not out.failed, out.metrics
    assert tool.seen == [("create", {"seed": 1}), ("execute", {"mode": "fast"}), ("execute", {"mode": "fast"}),
                         ("calc_reward", {"ground_truth": "7"}), ("release", {"keep": False})]
    assert out.reward_score == 0.5
    assert tool.live_instances == 0


async def test_row_kwargs_a_tool_cannot_take_fail_the_sample(tokenizer, scripted):
    server = scripted([hermes_call("calculator", expression="1 + 1"), "2"])
    record = RecordingTool()
    loop = ReactAgentLoop(server, tokenizer, {"tools": {"calculator": calculator, "record": record}})
    # calculator is a function tool without hidden parameters: execute_kwargs have nowhere to go.
    with pytest.raises(ToolKwargsError, match=r"function tool 'calculator'.*\['precision'\]"):
        await loop.run({}, raw_prompt=PROMPT, tools_kwargs={"calculator": {"execute_kwargs": {"precision": 3}}})
    assert server.calls == []
    assert calculator.live_instances == 0
    assert record.live_instances == 0
    assert ("release", {}) in record.seen  # the other tool's instance was released


async def test_max_parallel_calls_answers_later_calls_as_the_tool_agent_loop_does(tokenizer, scripted):
    replies = ["\n".join(hermes_call("calculator", expression=f"{i} + 1") for i in range(3)), "done"]
    graph_server, tool_server = scripted(replies), scripted(replies)
    graph_out = await run_loop(graph_server, tokenizer, {"max_parallel_calls": 2})
    tool_loop = ToolAgentLoop(tool_server, tokenizer, {"tools": {"calculator": calculator}, "max_parallel_calls": 2})
    tool_out = await tool_loop.run({"temperature": 0.0, "logprobs": True}, raw_prompt=PROMPT)

    tool_texts = [m["content"] for m in graph_out.extra_fields["messages"] if m["role"] == "tool"]
    assert tool_texts[:2] == ["1", "2"]
    assert tool_texts[2] == ("Error: too many tool calls in one turn (limit 2); this call to 'calculator' was "
                             "not run. Call it again next turn.")
    assert graph_out.metrics["tool_calls_over_limit"] == 1
    assert graph_out.metrics["tool_errors"] == 1
    assert graph_out.extra_fields["messages"] == tool_out.extra_fields["messages"]
    assert graph_out.response_ids == tool_out.response_ids
    assert graph_out.response_mask == tool_out.response_mask


@pytest.mark.parametrize("strategy", ["history", "short"])
async def test_delta_strategy_reaches_the_renderer(tokenizer, scripted, strategy):
    loop = ReactAgentLoop(scripted(REPLIES), tokenizer, {"tools": {"calculator": calculator},
                                                         "delta_strategy": strategy})
    model = loop.chat_model({"temperature": 0.0}, "r")
    assert model.delta_strategy == strategy
    assert model.max_parallel_calls == 4
    assert model._renderer([], "[]").delta_strategy == strategy
    out = await run_loop(scripted(REPLIES), tokenizer, {"delta_strategy": strategy})
    assert not out.failed
    assert out.extra_fields["termination_reason"] == "graph_end"
    with pytest.raises(ValueError, match="delta_strategy must be one of"):
        ReactAgentLoop(object(), tokenizer, {"delta_strategy": "fast"})


def test_loop_declares_its_config_class():
    assert ReactAgentLoop.config_class is ReactAgentConfig
    check_loop_config_keys("react_agent", ReactAgentLoop.config_class,
                           ["graph_factory", "max_parallel_calls", "delta_strategy", "tools", "tool_config_path"])
    with pytest.raises(ValueError, match=r"'interaction_config_path'.*valid keys:"):
        check_loop_config_keys("react_agent", ReactAgentConfig, ["interaction_config_path"])
    with pytest.raises(ValueError, match=r"'graph_factory_kwarg' \(did you mean 'graph_factory_kwargs'\?\)"):
        check_loop_config_keys("react_agent", ReactAgentConfig, ["graph_factory_kwarg"])


class _BigTool(BaseTool):
    """Answers every call with ~1 MB of digits and words."""

    def __init__(self) -> None:
        super().__init__({}, {"type": "function", "function": {"name": "big", "description": "a big tool",
                                                                "parameters": {"type": "object", "properties": {}}}})

    async def execute(self, instance_id, parameters):
        return ToolResponse(text="0123456789 abc\n" * 70_000), 0.0, {}


@pytest.mark.parametrize("side", ["left", "right", "middle"])
async def test_tool_response_token_budget_applies_as_in_tool_agent(tokenizer, scripted, side):
    from agentloop_tools.truncation import TRUNCATION_MARKER, truncate_tokens

    server = scripted([hermes_call("big"), "done"])
    loop = ReactAgentLoop(server, tokenizer, {"tools": {"big": _BigTool()}, "max_tool_response_length": None,
                                              "max_tool_response_tokens": 64, "tool_response_truncate_side": side})
    out = await loop.run({"temperature": 0.0, "logprobs": True}, raw_prompt=PROMPT)
    assert not out.failed, out.metrics
    (text,) = [m["content"] for m in out.extra_fields["messages"] if m["role"] == "tool"]
    assert text == truncate_tokens("0123456789 abc\n" * 70_000, 64, side, tokenizer)
    assert TRUNCATION_MARKER in text
    assert len(tokenizer.encode(text, add_special_tokens=False)) <= 64
    assert out.metrics["tool_responses_truncated_tokens"] == 1
    assert out.metrics["tool_responses_truncated_length"] == 0
