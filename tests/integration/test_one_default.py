"""One default per concept across the packages (#47): the response length and the tool parser are
declared once in core and every loop config, engine-side loop, chat model, conformance profile
and the trainer's config carry that same value; a loop holds its options under one attribute."""

from __future__ import annotations

import dataclasses
import inspect

import pytest

pytest.importorskip("agentloop_trainer", reason="needs agentloop-trainer (nox -s integration)")
pytest.importorskip("agentloop_langgraph", reason="needs agentloop-langgraph (nox -s integration)")

from agentloop_conformance.turns import LoopProfile, discover_profile  # noqa: E402
from agentloop_core import DEFAULT_RESPONSE_LENGTH, AgentLoopBase, SamplingParams  # noqa: E402
from agentloop_core.parsers import DEFAULT_TOOL_PARSER  # noqa: E402
from agentloop_engines.serving.http_agent import HTTPAgentConfig, HTTPAgentLoop  # noqa: E402
from agentloop_langgraph.chat_model import ChatModel  # noqa: E402
from agentloop_langgraph.loop import ReactAgentConfig, ReactAgentLoop  # noqa: E402
from agentloop_tools.agent_loop import ToolAgentLoop  # noqa: E402
from agentloop_tools.env_agent import EnvAgentConfig, EnvAgentLoop  # noqa: E402
from agentloop_tools.loop_config import ToolAgentConfig, ToolLoopConfig  # noqa: E402
from agentloop_trainer.config import DataSection  # noqa: E402


def _default(cls: type, name: str) -> object:
    return {f.name: f.default for f in dataclasses.fields(cls)}[name]


def test_every_response_length_default_is_the_one_constant():
    defaults = {
        "SamplingParams.max_tokens (a call given no cap)": _default(SamplingParams, "max_tokens"),
        "ToolLoopConfig.response_length": _default(ToolLoopConfig, "response_length"),
        "ToolAgentConfig.response_length": _default(ToolAgentConfig, "response_length"),
        "EnvAgentConfig.response_length": _default(EnvAgentConfig, "response_length"),
        "ReactAgentConfig.response_length": _default(ReactAgentConfig, "response_length"),
        "HTTPAgentConfig.response_length": _default(HTTPAgentConfig, "response_length"),
        "trainer data.max_response_length": _default(DataSection, "max_response_length"),
    }
    assert {k: v for k, v in defaults.items() if v != DEFAULT_RESPONSE_LENGTH} == {}


def test_http_agent_reads_an_unset_response_length_as_the_default():
    """A rollout without a budget hands the loops ``response_length=None``: the default applies."""
    config = HTTPAgentConfig.from_mapping({"agent": print, "response_length": None})
    assert config.response_length == DEFAULT_RESPONSE_LENGTH
    with pytest.raises(ValueError, match="http_agent: response_length must be a positive integer"):
        HTTPAgentConfig.from_mapping({"agent": print, "response_length": 0})


def test_every_tool_parser_default_is_the_one_constant():
    defaults = {
        "ToolLoopConfig.tool_parser": _default(ToolLoopConfig, "tool_parser"),
        "HTTPAgentConfig.tool_parser": _default(HTTPAgentConfig, "tool_parser"),
        "ChatModel.tool_parser": ChatModel.model_fields["tool_parser"].default,
        "conformance LoopProfile.tool_parser": _default(LoopProfile, "tool_parser"),
        "http_agent from_mapping": HTTPAgentConfig.from_mapping({"agent": print}).tool_parser,
        "conformance discovery of a loop without one": discover_profile(object()).tool_parser,
    }
    assert {k: v for k, v in defaults.items() if v != DEFAULT_TOOL_PARSER} == {}


@pytest.mark.parametrize("loop_class", [AgentLoopBase, ToolAgentLoop, EnvAgentLoop, ReactAgentLoop, HTTPAgentLoop])
def test_a_loop_holds_its_options_under_one_attribute(loop_class):
    """``self.config`` only: a second name for the same object (``self.settings``) is gone."""
    source = "".join(inspect.getsource(k) for k in loop_class.__mro__ if k.__module__.startswith("agentloop"))
    assert "self.settings" not in source
