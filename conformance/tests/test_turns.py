"""The call writers, turn classification and loop discovery behind the agent loop suite's
scripted tool turns."""

from __future__ import annotations

import pytest

from agentloop_conformance.turns import (
    CALL_WRITERS,
    UNKNOWN_TOOL,
    LoopProfile,
    TurnScript,
    classify_text,
    discover_profile,
    load_parser,
    write_calls,
    write_malformed_call,
)
from agentloop_core.testing import load_tiny_tokenizer

TOOLS = {name: {"name": name, "parameters": {"type": "object", "properties": {"x": {"type": "string"}},
                                              "required": ["x"]}} for name in ("alpha", "beta")}


@pytest.mark.parametrize("fmt", sorted(CALL_WRITERS))
def test_each_writer_writes_calls_its_parser_reads(fmt):
    parser = load_parser(fmt)
    parsed = parser.parse(write_calls(fmt, [("alpha", {"x": "1"}), ("beta", {"x": "2"})]), TOOLS)
    assert [(c.name, c.arguments) for c in parsed.calls] == [("alpha", {"x": "1"}), ("beta", {"x": "2"})]
    assert not parsed.errors
    assert classify_text(write_calls(fmt, [("alpha", {"x": "1"})]), parser, TOOLS) == "tool_call"
    assert classify_text(write_malformed_call(fmt, "alpha"), parser, TOOLS) == "malformed_call"
    assert classify_text(write_calls(fmt, [(UNKNOWN_TOOL, {})]), parser, TOOLS) == "unknown_tool"
    assert classify_text("The answer is 5.", parser, TOOLS) == "final_answer"


def test_the_script_plays_one_scenario_per_row_and_labels_each_turn():
    script = TurnScript(LoopProfile(TOOLS, "hermes", failing_arguments={"alpha": {"x": "1/0"}}),
                        load_tiny_tokenizer())
    kinds = []
    for row in range(len(script.scenarios)):
        script.row = row
        for index in range(2):
            script(f"r{row}", [1], index)
            kinds.append(script.labels[(f"r{row}", index)])
    assert {"tool_call", "parallel_calls", "malformed_call", "unknown_tool", "tool_error", "truncated",
            "final_answer"} <= set(kinds)
    assert "user_turn" in script.skipped


def test_discovery_reads_tool_agent_and_a_declared_profile():
    tools = pytest.importorskip("agentloop_tools", reason="needs pip install agentloop-tools")
    loop = tools.ToolAgentLoop(None, load_tiny_tokenizer(), {"tools": {"calculator": tools.calculator},
                                                             "tool_parser": "hermes"})
    profile = discover_profile(loop)
    assert list(profile.tools) == ["calculator"]
    assert profile.tool_parser == "hermes"
    assert not profile.interaction

    class Declared:
        def conformance_profile(self):
            return {"tools": [{"type": "function", "function": TOOLS["alpha"]}], "tool_parser": "mistral",
                    "failing_arguments": {"alpha": {"x": ""}}}

    declared = discover_profile(Declared())
    assert list(declared.tools) == ["alpha"]
    assert declared.tool_parser == "mistral"
    assert declared.failing_arguments == {"alpha": {"x": ""}}


def test_a_loop_without_tools_reports_none():
    class Plain:
        config = {}

    assert discover_profile(Plain()).tools == {}
