"""ToolResponse and OpenAIFunctionToolSchema records."""

import pytest
from pydantic import ValidationError

from agentloop_tools.schema import OpenAIFunctionToolSchema, ToolResponse


def test_tool_response_rejects_non_string_text():
    with pytest.raises(TypeError, match="json.dumps"):
        ToolResponse(text={"a": 1})
    with pytest.raises(TypeError, match="image must be a list"):
        ToolResponse(image="pic.png")
    assert ToolResponse().is_empty()
    assert not ToolResponse(text="x").is_empty()


def test_schema_round_trip_keeps_extra_json_schema_keys():
    raw = {
        "type": "function",
        "function": {
            "name": "search",
            "description": "Search.",
            "parameters": {
                "type": "object",
                "properties": {"q": {"type": "string"}},
                "required": ["q"],
                "additionalProperties": False,
                "$defs": {"X": {"type": "integer"}},
            },
        },
    }
    schema = OpenAIFunctionToolSchema.model_validate(raw)
    assert schema.name == "search"
    # What goes into apply_chat_template(tools=...) must be the same JSON the server sent.
    assert schema.model_dump(exclude_none=True) == raw


@pytest.mark.parametrize(
    "bad",
    [
        {"type": "function", "function": {"name": "has space"}},
        {"type": "function", "function": {"name": ""}},
        {"type": "tool", "function": {"name": "x"}},
        {"type": "function", "function": {"name": "x", "parameters": {"type": "array"}}},
        {"type": "function", "function": {"name": "x", "parameters": {"required": ["a", "a"]}}},
        {"type": "function", "function": {"name": "x"}, "extra": 1},
    ],
)
def test_schema_rejects_malformed(bad):
    with pytest.raises(ValidationError):
        OpenAIFunctionToolSchema.model_validate(bad)
