"""ChatModel on its own: what it keeps on each AIMessage, how later calls extend the recorded
ids, and which histories it refuses. The engine is scripted (ScriptedServer) so the replies are
exact; the tokenizer, chat template, parser and LangChain are real."""

from __future__ import annotations

import asyncio

import pytest
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage
from langgraph_helpers import hermes_call

from agentloop_core.testing import ScriptedServer
from agentloop_langgraph import METADATA_KEY, REQUEST_ID_KEY, ChatModel, HistoryRewrittenError
from agentloop_langgraph.tools import to_langchain_tool
from agentloop_tools.builtin import calculator

QUESTION = [SystemMessage("Use the calculator."), HumanMessage("What is 6 * 7?")]


@pytest.fixture
async def calc_tool():
    iid = await calculator.create(None)
    yield to_langchain_tool(calculator, iid)
    await calculator.release(iid)


def model_for(server, tokenizer, **kw) -> ChatModel:
    return ChatModel(server=server, tokenizer=tokenizer, sampling_params={"temperature": 0.0}, **kw)


async def test_ai_message_keeps_ids_logprobs_and_parsed_calls(tokenizer, scripted, calc_tool):
    server = scripted([hermes_call("calculator", expression="6 * 7")])
    model = model_for(server, tokenizer, request_id="r1").bind_tools([calc_tool])
    msg = await model.ainvoke(QUESTION)

    info = msg.response_metadata[METADATA_KEY]
    call = server.calls[0]
    assert info["request_id"] == "r1" == call.request_id
    assert info["turn"] == 1
    assert info["prompt_ids"] == call.prompt_ids
    assert info["response_ids"] == call.output.token_ids
    assert info["log_probs"] == call.output.log_probs
    assert msg.tool_calls == [{"name": "calculator", "args": {"expression": "6 * 7"}, "id": "call_1_call_0",
                               "type": "tool_call"}]
    assert msg.content == ""
    assert msg.response_metadata["finish_reason"] == "tool_calls"
    # The bound tool's exact schema was rendered into the prompt.
    assert '"name": "calculator"' in tokenizer.decode(call.prompt_ids)


async def test_later_calls_extend_the_recorded_ids(tokenizer, scripted, calc_tool):
    server = scripted([hermes_call("calculator", expression="6 * 7"), "42"])
    chat = model_for(server, tokenizer)
    model = chat.bind_tools([calc_tool])
    first = await model.ainvoke(QUESTION)
    tool_msg = await calc_tool.ainvoke(first.tool_calls[0])
    second = await model.ainvoke([*QUESTION, first, tool_msg])

    c1, c2 = server.calls
    assert c2.prompt_ids[: len(c1.prompt_ids) + len(c1.output.token_ids)] == c1.prompt_ids + c1.output.token_ids
    assert "<tool_response>\n42\n</tool_response>" in tokenizer.decode(c2.prompt_ids)
    assert second.content == "42"
    assert second.tool_calls == []
    traj = chat.session().trajectory
    assert [t for t, m in zip(traj.response_ids, traj.response_mask, strict=True) if m] == \
        c1.output.token_ids + c2.output.token_ids


async def test_malformed_calls_become_invalid_tool_calls(tokenizer, scripted, calc_tool):
    server = scripted(['<tool_call>{"name": "calculator", "arguments": </tool_call> and ' +
                       hermes_call("search", q="x")])
    msg = await model_for(server, tokenizer).bind_tools([calc_tool]).ainvoke(QUESTION)
    assert msg.tool_calls == []
    assert [c["error"].split(" ")[0:3] for c in msg.invalid_tool_calls][0] == ["the", "tool", "call"]
    assert msg.invalid_tool_calls[1]["name"] == "search"
    assert "unknown tool" in msg.invalid_tool_calls[1]["error"]


async def test_a_turn_cut_by_the_budget_is_not_parsed_for_calls(tokenizer, scripted, calc_tool):
    text = hermes_call("calculator", expression="6 * 7")
    server = scripted([text])
    n = len(tokenizer.encode(text, add_special_tokens=False))
    model = ChatModel(server=server, tokenizer=tokenizer, sampling_params={"max_tokens": n - 3}).bind_tools([calc_tool])
    msg = await model.ainvoke(QUESTION)
    assert msg.tool_calls == []
    assert msg.invalid_tool_calls == []
    assert msg.response_metadata["finish_reason"] == "length"


async def test_one_model_keeps_one_trajectory_per_request_id(tokenizer):
    server = ScriptedServer(lambda rid, prompt, i: [ord(rid[-1]) % 50 + 100 + i])
    chat = model_for(server, tokenizer)

    async def converse(rid: str):
        config = {"configurable": {REQUEST_ID_KEY: rid}}
        history = [HumanMessage(f"hello {rid}")]
        for turn in range(3):
            history.append(await chat.ainvoke(history, config=config))
            history.append(HumanMessage(f"again {turn}"))
            await asyncio.sleep(0)

    await asyncio.gather(converse("traj-a"), converse("traj-b"))
    for rid in ("traj-a", "traj-b"):
        calls = [c for c in server.calls if c.request_id == rid]
        assert len(calls) == 3
        traj = chat.session(rid).trajectory
        assert [t for t, m in zip(traj.response_ids, traj.response_mask, strict=True) if m] == \
            [t for c in calls for t in c.output.token_ids]


async def test_turns_stay_on_one_replica_of_the_client(tokenizer):
    client = pytest.importorskip("agentloop_engines.fleet.client", reason="agentloop-engines is not installed")
    LLMServerClient = client.LLMServerClient
    replicas = [ScriptedServer(lambda rid, p, i: [200 + i]) for _ in range(2)]
    chat = model_for(LLMServerClient(replicas), tokenizer)

    async def converse(rid: str):
        history = [HumanMessage("hi")]
        for _ in range(4):
            history += [await chat.ainvoke(history, config={"configurable": {REQUEST_ID_KEY: rid}}),
                        HumanMessage("more")]

    await asyncio.gather(*(converse(f"t{i}") for i in range(4)))
    for i in range(4):
        served_by = {k for k, r in enumerate(replicas) for c in r.calls if c.request_id == f"t{i}"}
        assert len(served_by) == 1, f"t{i} was served by replicas {served_by}"
    assert all(r.calls for r in replicas)  # least in-flight spread the trajectories


async def test_history_that_is_not_an_extension_is_refused_with_on_history_rewrite_error(tokenizer, scripted):
    server = scripted(["one", "two", "three"])
    chat = model_for(server, tokenizer, on_history_rewrite="error")
    first = await chat.ainvoke(QUESTION)

    with pytest.raises(HistoryRewrittenError, match="message 1 differs"):
        await chat.ainvoke([QUESTION[0], HumanMessage("What is 6 * 8?"), first, HumanMessage("and?")])
    with pytest.raises(HistoryRewrittenError, match="engine did not generate"):
        await chat.ainvoke([*QUESTION, first, HumanMessage("x"), AIMessage("I wrote this myself"),
                            HumanMessage("y")])
    with pytest.raises(HistoryRewrittenError, match="expected the AI message generated at turn 1"):
        await chat.ainvoke([*QUESTION, AIMessage("one"), HumanMessage("and?")])
    with pytest.raises(HistoryRewrittenError, match="at least one new message"):
        await chat.ainvoke([*QUESTION, first])
    assert len(server.calls) == 1  # nothing was generated for a refused history
    # The recorded trajectory is untouched: a correct extension still works.
    second = await chat.ainvoke([*QUESTION, first, HumanMessage("and?")])
    assert second.response_metadata[METADATA_KEY]["turn"] == 2


async def test_few_shot_assistant_messages_in_the_prompt_are_rendered_with_mask_0(tokenizer, scripted):
    server = scripted(["ok"])
    chat = model_for(server, tokenizer)
    shot = AIMessage("", tool_calls=[{"name": "calculator", "args": {"expression": "1+1"}, "id": "s0"}])
    await chat.ainvoke([HumanMessage("1+1?"), shot, ToolMessage("2", tool_call_id="s0", name="calculator"),
                        HumanMessage("2+2?")])
    traj = chat.session().trajectory
    assert '{"expression": "1+1"}' in tokenizer.decode(traj.prompt_ids)
    assert list(traj.response_mask) == [1] * len(server.calls[0].output.token_ids)


async def test_unsupported_uses_are_clear_errors(tokenizer, scripted, calc_tool):
    chat = model_for(scripted(["a"]), tokenizer)
    with pytest.raises(NotImplementedError, match="async only"):
        chat.invoke(QUESTION)
    with pytest.raises(ValueError, match="stop strings"):
        await chat.ainvoke(QUESTION, stop=["\n"])
    with pytest.raises(ValueError, match="tool_choice"):
        chat.bind_tools([calc_tool], tool_choice="calculator")
    with pytest.raises(ValueError, match="unknown sampling parameter 'max_token'"):
        ChatModel(server=None, tokenizer=tokenizer, sampling_params={"max_token": 3})
    with pytest.raises(ValueError, match="last input message is an AI message"):
        await chat.ainvoke([HumanMessage("hi"), AIMessage("hello")])
