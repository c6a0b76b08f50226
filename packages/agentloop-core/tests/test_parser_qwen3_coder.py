"""The ``qwen3_coder`` XML tool-call parser: values typed by the schema, several calls per turn,
and each malformed call an error written for the model."""

from __future__ import annotations

import pytest

from agentloop_core.parsers import Qwen3CoderToolParser, get_tool_parser

TOOLS = {"search": {"type": "function", "function": {"name": "search", "parameters": {
    "type": "object",
    "properties": {"query": {"type": "string"}, "limit": {"type": "integer"}, "exact": {"type": "boolean"},
                   "filters": {"type": "object"}},
    "required": ["query"]}}}}


def block(name: str, **params: str) -> str:
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


def test_registered_and_values_typed_by_the_schema():
    parser = get_tool_parser("qwen3_coder")
    assert isinstance(parser, Qwen3CoderToolParser)
    text = "Searching. " + block("search", query="  two spaces\nand a line  ", limit="3", exact="True",
                                 filters='{"lang": "en"}')
    result = parser.parse(text, TOOLS, record=False)
    assert result.errors == []
    assert result.content == "Searching."
    assert result.calls[0].name == "search"
    assert result.calls[0].arguments == {"query": "  two spaces\nand a line  ", "limit": 3, "exact": True,
                                         "filters": {"lang": "en"}}


def test_several_calls_and_untyped_values_without_tools():
    result = Qwen3CoderToolParser().parse(block("a", x="1") + "\n" + block("b", y="[1, 2]"), record=False)
    assert [(c.id, c.name, c.arguments) for c in result.calls] == [("call_0", "a", {"x": "1"}),
                                                                    ("call_1", "b", {"y": "[1, 2]"})]


@pytest.mark.parametrize(("text", "kind", "reason"), [
    ("<tool_call>\n<function=search>\n<parameter=query>\nx\n</parameter>\n</function>", "unclosed_tag", "never closed"),
    ("<tool_call>\n<parameter=query>\nx\n</parameter>\n</tool_call>", "missing_name", "names no function"),
    ("<tool_call>\n<function=search>\n<parameter=query>\nx\n</tool_call>", "unclosed_tag", "</function>"),
    (block("search", query="x", limit="three"), "invalid_arguments", "integer written as JSON"),
    (block("search", limit="3"), "invalid_arguments", "query"),
    (block("nope", query="x"), "unknown_tool", "available tools: search"),
])
def test_malformed_calls_are_errors_for_the_model(text, kind, reason):
    result = Qwen3CoderToolParser().parse(text, TOOLS, record=False)
    assert result.calls == []
    assert [e.kind for e in result.errors] == [kind]
    assert reason in result.errors[0].reason
