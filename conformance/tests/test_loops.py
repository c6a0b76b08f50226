"""The agent loop suite against single_turn_agent and tool_agent, on a scripted engine and on
HFServer with the tiny model."""

from __future__ import annotations

import json

import pytest

from agentloop_conformance.agent_loop import AgentLoopConformanceTests
from agentloop_core.single_turn import SingleTurnAgentLoop
from agentloop_core.testing import load_tiny_tokenizer


@pytest.fixture(scope="module")
def tiny_engine():
    pytest.importorskip("torch", reason='HFServer needs pip install "agentloop-engines[hf]"')
    from agentloop_engines.adapters.hf import HFServer
    from agentloop_engines.testing.tiny_model import build_tiny_model

    return HFServer(build_tiny_model(initializer_range=0.3), max_model_len=1024)


class _OnTheTinyEngine(AgentLoopConformanceTests):
    """Our loops run the suite on the scripted engine and on the tiny HFServer."""

    @pytest.fixture
    def real_engine(self, tiny_engine):
        return tiny_engine


class _CallsTheCalculator(_OnTheTinyEngine):
    @pytest.fixture
    def scripted_replies(self):
        return ["I will compute. " + _call("2 + 3"), "Check: " + _call("5 * 1"), "The answer is 5.\n#### 5"]


class TestSingleTurnAgentConformance(_OnTheTinyEngine):
    @pytest.fixture
    def agent_loop_factory(self):
        tokenizer = load_tiny_tokenizer()
        return lambda server: SingleTurnAgentLoop(server, tokenizer, {"response_length": 16})


def _call(expression: str) -> str:
    return "<tool_call>\n" + json.dumps({"name": "calculator", "arguments": {"expression": expression}}) + "\n</tool_call>"


class TestToolAgentConformance(_OnTheTinyEngine):
    """The suite scripts the turns itself from the loop's tools (scripted_replies left None)."""

    @pytest.fixture
    def agent_loop_factory(self):
        from loop_factories import tool_agent

        return tool_agent


class TestToolAgentWithGivenRepliesConformance(_CallsTheCalculator):
    @pytest.fixture
    def agent_loop_factory(self):
        tools = pytest.importorskip("agentloop_tools", reason="needs pip install agentloop-tools")
        tokenizer = load_tiny_tokenizer()
        config = {"tools": {"calculator": tools.calculator}, "response_length": 400}
        return lambda server: tools.ToolAgentLoop(server, tokenizer, config)


class TestEnvAgentConformance(_OnTheTinyEngine):
    """env_agent with an environment that answers the calculator's calls: the suite scripts the
    tool turns from the environment's schemas (EnvAgentLoop.conformance_profile)."""

    @pytest.fixture
    def agent_loop_factory(self):
        pytest.importorskip("agentloop_tools", reason="needs pip install agentloop-tools")
        from loop_factories import env_agent

        return env_agent


class TestReactAgentConformance(_OnTheTinyEngine):
    @pytest.fixture
    def agent_loop_factory(self):
        from loop_factories import react_agent

        return react_agent


class TestSegmentingLoopConformance(_OnTheTinyEngine):
    """A loop that returns two segments per row (SegmentBuilder over its recorded calls)."""

    @pytest.fixture
    def agent_loop_factory(self):
        from segment_loops import summarising_loop

        return summarising_loop


class TestSummarisingReactAgentConformance(_CallsTheCalculator):
    """react_agent running a LangGraph graph that replaces its earlier turns by a summary: its
    trajectories come back as segments (on_history_rewrite="segment", the default)."""

    @pytest.fixture
    def agent_loop_factory(self):
        langgraph = pytest.importorskip("agentloop_langgraph", reason="needs pip install agentloop-langgraph")
        tools = pytest.importorskip("agentloop_tools", reason="needs pip install agentloop-tools")
        tokenizer = load_tiny_tokenizer()
        config = {"tools": {"calculator": tools.calculator}, "response_length": 160, "max_assistant_turns": 4,
                  "graph_factory": "agentloop_langgraph.examples.summarising_agent:summarising_agent",
                  # The nudge keeps a model that never calls the tool (the random tiny model) going.
                  "graph_factory_kwargs": {"summarise_after": 2, "keep_last_turns": 1, "nudge": "Check it again."}}
        return lambda server: langgraph.ReactAgentLoop(server, tokenizer, config)


def _openai_calculator_agent(base_url: str, row: dict) -> float:
    """An agent written with the stock openai client: answers tool calls until the model stops."""
    import openai

    client = openai.OpenAI(base_url=base_url, api_key="unused")
    messages = list(row["raw_prompt"])
    tools = [{"type": "function", "function": {
        "name": "calculator", "description": "Evaluate an arithmetic expression.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}]
    for _ in range(4):
        message = client.chat.completions.create(model="any", messages=messages, tools=tools,
                                                 max_tokens=64).choices[0].message
        if not message.tool_calls:
            return float("5" in (message.content or ""))
        messages.append(message.model_dump(exclude_none=True))
        for call in message.tool_calls:
            value = eval(json.loads(call.function.arguments)["expression"], {"__builtins__": {}})  # test input only
            messages.append({"role": "tool", "tool_call_id": call.id, "content": str(value)})
    return 0.0


class TestHTTPAgentConformance(_CallsTheCalculator):
    """http_agent: an OpenAI-client agent against a recording gateway session; its recorded calls
    are the trajectory (one segment while each call extends the last)."""

    @pytest.fixture
    def agent_loop_factory(self):
        pytest.importorskip("openai", reason="needs pip install openai")
        pytest.importorskip("fastapi", reason='needs pip install "agentloop-engines[server]"')
        from agentloop_engines.serving.http_agent import HTTPAgentLoop, close_gateways

        tokenizer = load_tiny_tokenizer()
        yield lambda server: HTTPAgentLoop(server, tokenizer, {"agent": _openai_calculator_agent,
                                                               "response_length": 160})
        close_gateways()
