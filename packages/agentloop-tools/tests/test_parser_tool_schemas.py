"""The parsers (agentloop_core.parsers) accept the tools package's own schema objects where a
tool spec is expected."""

from __future__ import annotations

from agentloop_core.parsers import get_tool_parser, tool_parameters
from agentloop_tools.schema import OpenAIFunctionToolSchema

CALC = OpenAIFunctionToolSchema.model_validate({
    "type": "function",
    "function": {"name": "calculator", "description": "evaluate", "parameters": {
        "type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}},
})


def test_tool_parameters_accepts_the_pydantic_schema():
    expected = CALC.function.parameters.model_dump(exclude_none=True)
    assert tool_parameters(CALC) == expected
    assert tool_parameters(CALC.model_dump()) == CALC.model_dump()["function"]["parameters"]
    result = get_tool_parser("hermes").parse(
        '<tool_call>\n{"name": "calculator", "arguments": {"expression": "1+1"}}\n</tool_call>', {"calculator": CALC})
    assert [call.arguments for call in result.calls] == [{"expression": "1+1"}]
    assert not result.errors
