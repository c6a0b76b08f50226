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
    from agentloop_engines.hf import HFServer
    from agentloop_engines.tiny_model import build_tiny_model

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


class TestToolAgentConformance(_CallsTheCalculator):
    @pytest.fixture
    def agent_loop_factory(self):
        tools = pytest.importorskip("agentloop_tools", reason="needs pip install agentloop-tools")
        tokenizer = load_tiny_tokenizer()
        config = {"tools": {"calculator": tools.calculator}, "response_length": 160}
        return lambda server: tools.ToolAgentLoop(server, tokenizer, config)


class TestReactAgentConformance(_CallsTheCalculator):
    @pytest.fixture
    def agent_loop_factory(self):
        langgraph = pytest.importorskip("agentloop_langgraph", reason="needs pip install agentloop-langgraph")
        tools = pytest.importorskip("agentloop_tools", reason="needs pip install agentloop-tools")
        tokenizer = load_tiny_tokenizer()
        config = {"tools": {"calculator": tools.calculator}, "response_length": 160}
        return lambda server: langgraph.ReactAgentLoop(server, tokenizer, config)

    @pytest.fixture
    def scripted_replies(self):
        return ["I will compute. " + _call("2 + 3"), "The answer is 5.\n#### 5"]


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
