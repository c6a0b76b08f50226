"""Tool-call parsers: hermes and llama3_json, the registry, the schema check and aggregated logs."""

from __future__ import annotations

import json
import logging

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agentloop_core.parsers import (
    HermesToolParser,
    Llama3JsonToolParser,
    ParseStats,
    ToolCall,
    UnknownToolParserError,
    check_arguments,
    get_tool_parser,
    tool_parameters,
    tool_parser_names,
)

CALC = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "evaluate",
        "parameters": {
            "type": "object",
            "properties": {
                "expression": {"type": "string"},
                "precision": {"type": "integer"},
                "mode": {"type": "string", "enum": ["exact", "float"]},
            },
            "required": ["expression"],
        },
    },
}
TOOLS = {"calculator": CALC, "search": {"type": "function", "function": {"name": "search", "parameters": {
    "type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}}}}


def hermes_call(name: str, arguments: object) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


def test_registry_lists_names_and_explains_unknown():
    assert {"hermes", "llama3_json"} <= set(tool_parser_names())
    assert isinstance(get_tool_parser("hermes"), HermesToolParser)
    assert get_tool_parser("hermes") is get_tool_parser("hermes")
    with pytest.raises(UnknownToolParserError, match=r"unknown tool parser .qwen.; known tool parsers: .*hermes, .*llama3_json.*register_tool_parser"):
        get_tool_parser("qwen")


def test_hermes_several_calls_and_content():
    text = "Let me compute.\n" + hermes_call("calculator", {"expression": "2+3"}) + "\n" + hermes_call(
        "search", {"query": "apples"})
    result = HermesToolParser().parse(text, TOOLS)
    assert result.content == "Let me compute."
    assert result.errors == []
    assert result.calls == [
        ToolCall("call_0", "calculator", {"expression": "2+3"}),
        ToolCall("call_1", "search", {"query": "apples"}),
    ]


def test_hermes_no_call_is_plain_content():
    result = HermesToolParser().parse("The answer is 5.\n#### 5", TOOLS)
    assert (result.content, result.calls, result.errors, result.attempted) == ("The answer is 5.\n#### 5", [], [], False)


@pytest.mark.parametrize(
    ("text", "kind", "fragment"),
    [
        ("<tool_call>{not json}</tool_call>", "invalid_json", "not valid JSON"),
        ('<tool_call>{"name": "calculator", "arguments": {"expression": "1"}}', "unclosed_tag", "never closed"),
        ('x </tool_call> y', "stray_tag", "without an opening"),
        ("<tool_call><tool_call>{}</tool_call></tool_call>", "nested_tag", "cannot be nested"),
        ('<tool_call>{"arguments": {}}</tool_call>', "missing_name", 'no "name"'),
        ('<tool_call>[1, 2]</tool_call>', "missing_name", "JSON object"),
        (hermes_call("rm_rf", {}), "unknown_tool", "available tools: calculator, search"),
        (hermes_call("calculator", {}), "invalid_arguments", "arguments.expression is required"),
        (hermes_call("calculator", {"expression": 3}), "invalid_arguments", "must be of type string, got integer"),
        (hermes_call("calculator", {"expression": "1", "precision": True}), "invalid_arguments", "type integer"),
        (hermes_call("calculator", {"expression": "1", "mode": "fast"}), "invalid_arguments", "must be one of"),
        (hermes_call("calculator", "[1]"), "invalid_arguments", "must be a JSON object"),
        ('<tool_call>{"name": "calculator", "arguments": "{oops"}</tool_call>', "invalid_arguments", "not valid JSON"),
    ],
)
def test_hermes_malformed_calls_become_errors(text, kind, fragment):
    result = HermesToolParser().parse(text, TOOLS)
    assert result.calls == []
    assert [e.kind for e in result.errors][:1] == [kind]
    assert fragment in result.errors[0].reason
    assert result.attempted


def test_hermes_string_arguments_and_valid_call_next_to_broken_one():
    text = '<tool_call>{"name": "calculator", "arguments": "{\\"expression\\": \\"4*4\\"}"}</tool_call>' \
        "<tool_call>{broken</tool_call>"
    result = HermesToolParser().parse(text, TOOLS)
    assert result.calls == [ToolCall("call_0", "calculator", {"expression": "4*4"})]
    assert [e.kind for e in result.errors] == ["invalid_json"]
    assert result.errors[0].raw == "<tool_call>{broken</tool_call>"


def test_hermes_closing_tag_inside_a_string_argument():
    code = 'print("</tool_call>")'
    text = hermes_call("calculator", {"expression": code}) + " done"
    result = HermesToolParser().parse(text, TOOLS)
    assert result.errors == []
    assert result.calls == [ToolCall("call_0", "calculator", {"expression": code})]
    assert result.content == "done"


def test_hermes_without_tools_accepts_any_name():
    result = HermesToolParser().parse(hermes_call("anything", {"a": [1]}), None)
    assert result.calls == [ToolCall("call_0", "anything", {"a": [1]})]


@pytest.mark.parametrize(("parser_name", "call"), [
    ("hermes", '<tool_call>\n{"name": "calc", "arguments": {"expression": "3 \\ud800 4"}}\n</tool_call>'),
    ("hermes", '<tool_call>\n{"name": "calc", "arguments": {"\\udfff": 1}}\n</tool_call>'),
    ("hermes", '<tool_call>\n{"name": "calc", "arguments": "{\\"x\\": [\\"\\\\ud800\\"]}"}\n</tool_call>'),
    ("hermes", '<tool_call>\n{"name": "c\\ud800", "arguments": {}}\n</tool_call>'),
    ("llama3_json", '{"name": "calc", "parameters": {"expression": "\\ud83d"}}'),
])
def test_a_lone_surrogate_the_policy_escapes_into_a_call_is_an_error_not_a_call(parser_name, call):
    """json.loads turns an unpaired \\udXXX escape into a string UTF-8 cannot encode: a tool, a
    tokenizer and a JSON answer would all fail on it. Every text the result holds encodes."""
    result = type(get_tool_parser(parser_name))().parse(call, None)
    assert result.calls == []
    assert [e.kind for e in result.errors] in (["invalid_arguments"], ["missing_name"])
    assert "lone UTF-16 surrogate" in result.errors[0].reason
    for text in (result.content, result.errors[0].raw, result.errors[0].reason, result.errors[0].name or ""):
        text.encode("utf-8")
    paired = type(get_tool_parser(parser_name))().parse(call.replace("\\ud800", "\\ud83d\\ude00"), None)
    if "\\ud800 4" in call:  # a surrogate pair is one character: a call
        assert paired.calls[0].arguments == {"expression": "3 \U0001f600 4"}


def test_llama3_json_calls():
    parser = get_tool_parser("llama3_json")
    assert parser.stop_tokens == ("<|eom_id|>", "<|eot_id|>")
    text = '<|python_tag|>{"name": "calculator", "parameters": {"expression": "1+1"}}; {"name": "search", "parameters": {"query": "x"}}<|eom_id|>'
    result = parser.parse(text, TOOLS)
    assert result.errors == []
    assert [(c.name, c.arguments) for c in result.calls] == [("calculator", {"expression": "1+1"}), ("search", {"query": "x"})]


@pytest.mark.parametrize(
    ("text", "calls", "kinds", "content"),
    [
        ("The answer is 4.", 0, [], "The answer is 4."),
        ('{"answer": 4}', 0, [], '{"answer": 4}'),
        ("{ not json and not a call", 0, [], "{ not json and not a call"),
        ('{"name": "calculator", "parameters": {"expression": "1"}} and more', 1, ["trailing_text"], ""),
        ('{"name": "calculator", "parameters": {"expression": "1"}}; {"name": "nope", "parameters": {}}', 1, ["unknown_tool"], ""),
        ('{"name": "calculator", "parameters": {"expression": "1"}}; {broken', 1, ["invalid_json"], ""),
        ('<|python_tag|>{broken', 0, ["invalid_json"], ""),
        ('{"name": "calculator", "parameters": {}}', 0, ["invalid_arguments"], ""),
    ],
)
def test_llama3_json_edge_cases(text, calls, kinds, content):
    result = Llama3JsonToolParser().parse(text, TOOLS)
    assert len(result.calls) == calls
    assert [e.kind for e in result.errors] == kinds
    assert result.content == content


def test_check_arguments_nested_and_additional_properties():
    schema = {
        "type": "object",
        "properties": {
            "xs": {"type": "array", "items": {"type": "number"}},
            "opt": {"type": ["string", "null"]},
            "n": {"type": "integer"},
        },
        "additionalProperties": False,
    }
    assert check_arguments({"xs": [1, 2.5], "opt": None, "n": 3.0}, schema) == []
    problems = check_arguments({"xs": [1, "a"], "opt": 1, "zzz": 0}, schema)
    assert problems == [
        "arguments.xs[1] must be of type number, got string 'a'",
        "arguments.opt must be of type string or null, got integer 1",
        "arguments.zzz is not an accepted argument; accepted: n, opt, xs",
    ]
    assert check_arguments([1], schema) == ["arguments must be a JSON object, got array [1]"]


def test_tool_parameters_accepts_every_spec_form():
    assert tool_parameters(CALC) == CALC["function"]["parameters"]
    assert tool_parameters({"name": "f", "parameters": {"type": "object"}}) == {"type": "object"}
    assert tool_parameters(None) is None
    assert tool_parameters(42) is None


def test_errors_are_logged_as_one_summary_per_batch(caplog):
    stats = ParseStats(log_every=50)
    parser = HermesToolParser(stats=stats)
    with caplog.at_level(logging.WARNING, logger="agentloop_core.parsers"):
        for _ in range(120):
            parser.parse("<tool_call>{bad</tool_call>", TOOLS)
        parser.parse(hermes_call("calculator", {"expression": "1"}), TOOLS)
    summaries = [r for r in caplog.records if "malformed tool calls" in r.getMessage()]
    assert len(summaries) == 2  # at 50 and 100 errors, never one per call
    assert "invalid_json=50" in summaries[0].getMessage()
    assert stats.as_dict() == {"turns": 121, "calls": 1, "errors/invalid_json": 120}
    with caplog.at_level(logging.WARNING, logger="agentloop_core.parsers"):
        stats.flush("hermes")
    assert "invalid_json=20" in caplog.records[-1].getMessage()


# --- fuzzing: the loop feeds parsers whatever a model writes, so they must never raise ----------

_fragments = st.sampled_from([
    "<tool_call>", "</tool_call>", "{", "}", "[", "]", '"name"', '"arguments"', '"parameters"', ":", ",", ";",
    '"calculator"', '"search"', '"expression"', "1", "null", "true", "\\", '"', "<|python_tag|>", "<|eom_id|>",
    "\n", " ", "NaN", "1e999", "[" * 50, "{" * 30,
])
_texts = st.one_of(st.text(max_size=200), st.lists(st.one_of(_fragments, st.text(max_size=5)), max_size=40).map("".join))
_schemas = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), st.text(max_size=5), st.sampled_from(["object", "string", "integer"])),
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(
        st.sampled_from(["type", "properties", "required", "enum", "items", "additionalProperties", "expression"]),
        inner, max_size=4)),
    max_leaves=12,
)


@settings(max_examples=300, deadline=None)
@given(text=_texts, parser_name=st.sampled_from(["hermes", "llama3_json"]))
def test_fuzz_parsers_never_raise(text, parser_name):
    parser = type(get_tool_parser(parser_name))()
    result = parser.parse(text, TOOLS)
    assert all(e.kind != "internal" for e in result.errors), result.errors
    for call in result.calls:
        assert call.name in TOOLS
        assert isinstance(call.arguments, dict)
        assert check_arguments(call.arguments, tool_parameters(TOOLS[call.name])) == []


@settings(max_examples=200, deadline=None)
@given(arguments=st.recursive(st.one_of(st.none(), st.booleans(), st.floats(allow_nan=False), st.text(max_size=4)),
                              lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=3), inner, max_size=3)),
                              max_leaves=10),
       schema=_schemas)
def test_fuzz_schema_check_never_raises(arguments, schema):
    problems = check_arguments(arguments, schema if isinstance(schema, dict) else None)
    assert isinstance(problems, list)
    assert all(isinstance(p, str) for p in problems)


@settings(max_examples=100, deadline=None)
@given(name=st.sampled_from(["calculator", "search"]), prose=st.text(max_size=30),
       value=st.lists(st.one_of(st.text(max_size=5), st.sampled_from(["<tool_call>", "</tool_call>"])), max_size=6).map("".join))
def test_fuzz_hermes_roundtrip_of_valid_calls(name, value, prose):
    key = "expression" if name == "calculator" else "query"
    prose = prose.replace("<tool_call>", "").replace("</tool_call>", "")
    result = HermesToolParser().parse(prose + hermes_call(name, {key: value}), TOOLS)
    assert result.errors == []
    assert result.calls == [ToolCall("call_0", name, {key: value})]
    assert result.content == prose.strip()
