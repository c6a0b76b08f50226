"""The parsers live in agentloop_core.parsers; agentloop_tools.parsers names the same objects,
and the tools package's own schema objects are accepted where a tool spec is."""

from __future__ import annotations

import agentloop_core.parsers as core_parsers
import agentloop_core.parsers.base as core_base
from agentloop_tools.parsers import ToolParser, get_tool_parser, tool_parameters, tool_parser_names
from agentloop_tools.parsers.base import ToolCall
from agentloop_tools.schema import OpenAIFunctionToolSchema

CALC = OpenAIFunctionToolSchema.model_validate({
    "type": "function",
    "function": {"name": "calculator", "description": "evaluate", "parameters": {
        "type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}},
})


def test_the_tools_names_are_the_core_objects():
    assert ToolParser is core_base.ToolParser
    assert ToolCall is core_base.ToolCall
    assert get_tool_parser("hermes") is core_parsers.get_tool_parser("hermes")
    assert {"hermes", "gpt_oss", "mistral", "llama3_json"} <= set(tool_parser_names())


def test_tool_parameters_accepts_the_pydantic_schema():
    expected = CALC.function.parameters.model_dump(exclude_none=True)
    assert tool_parameters(CALC) == expected
    assert tool_parameters(CALC.model_dump()) == CALC.model_dump()["function"]["parameters"]
    result = get_tool_parser("hermes").parse(
        '<tool_call>\n{"name": "calculator", "arguments": {"expression": "1+1"}}\n</tool_call>', {"calculator": CALC})
    assert [call.arguments for call in result.calls] == [{"expression": "1+1"}]
    assert not result.errors
