"""A stock LangChain agent (``ChatOpenAI`` + ``create_agent``) trained through the engines'
OpenAI-compatible gateway: the agent code is unchanged, only its ``base_url`` is a session URL.

The engine is scripted to emit the calculator calls (a random tiny model never calls tools on
purpose); LangChain, LangGraph, the openai client, HTTP, the chat template, the hermes parser
and the tool are real. If the recorded ids differ from ``server.calls``, the gateway lost,
reordered or re-encoded something the engine generated.
"""

from __future__ import annotations

import pytest
from langgraph_helpers import hermes_call

pytest.importorskip("langchain_openai", reason='needs: pip install "agentloop-langgraph[test]" (langchain-openai)')
pytest.importorskip("fastapi", reason='the gateway needs: pip install "agentloop-engines[server]"')
pytest.importorskip("uvicorn", reason='the gateway needs: pip install "agentloop-engines[server]"')
gateway_mod = pytest.importorskip("agentloop_engines.serving.gateway", reason="agentloop-engines>=0.3 has the gateway")

from langchain_core.tools import tool  # noqa: E402
from langchain_openai import ChatOpenAI  # noqa: E402

QUESTION = "What is (3 + 4) * 2?"
REPLIES = [hermes_call("calculator", expression="3 + 4"), hermes_call("calculator", expression="7 * 2"),
           "The answer is 14.\n#### 14"]


@tool
def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression.

    Args:
        expression: The expression, e.g. "3 + 4".
    """
    allowed = set("0123456789+-*/(). ")
    if not set(expression) <= allowed:
        return "error: only numbers and + - * / ( ) are allowed"
    return str(eval(expression, {"__builtins__": {}}))  # noqa: S307 - checked to arithmetic above


def create_agent_or_prebuilt(model, tools):
    try:
        from langchain.agents import create_agent
    except ImportError:  # langchain < 1.0: LangGraph's prebuilt agent is the same loop
        from langgraph.prebuilt import create_react_agent

        return create_react_agent(model, tools)
    return create_agent(model, tools)


async def test_create_agent_over_a_session_url_is_recorded_call_by_call(tokenizer, scripted):
    server = scripted(REPLIES)
    gateway = gateway_mod.Gateway(server, tokenizer, tool_parser="hermes")
    gateway.open_session("traj-42", sampling_overrides={"temperature": 1.0})
    with gateway_mod.GatewayThread(gateway, api_key="k") as thread:
        model = ChatOpenAI(base_url=thread.session_url("traj-42"), api_key="k", model="tiny", temperature=0,
                           max_retries=0, timeout=30)
        agent = create_agent_or_prebuilt(model, [calculator])
        result = await agent.ainvoke({"messages": [{"role": "user", "content": QUESTION}]})

    messages = result["messages"]
    assert messages[-1].content == "The answer is 14.\n#### 14"
    assert [m.content for m in messages if m.type == "tool"] == ["7", "14"]
    assert [c["args"] for m in messages if m.type == "ai" for c in m.tool_calls] == [
        {"expression": "3 + 4"}, {"expression": "7 * 2"}]

    calls = gateway.close_session("traj-42")
    assert len(calls) == len(server.calls) == 3
    for recorded, sent in zip(calls, server.calls, strict=True):
        assert recorded.prompt_ids == sent.prompt_ids
        assert recorded.token_ids == sent.output.token_ids
        assert recorded.log_probs == sent.output.log_probs
        assert sent.request_id == "traj-42"
        assert sent.sampling_params.temperature == 1.0
    assert [c.finish_reason for c in calls] == ["tool_calls", "tool_calls", "stop"]
    # LangChain sends the calls back with JSON-string arguments; rendered again they are the
    # text the engine generated, so each prompt extends the previous prompt + generation (one
    # segment for training).
    for before, after in zip(calls, calls[1:], strict=False):
        assert after.prompt_ids[: len(before.prompt_ids) + len(before.token_ids)] == \
            before.prompt_ids + before.token_ids
    assert calls[0].request["tools"][0]["function"]["name"] == "calculator"
