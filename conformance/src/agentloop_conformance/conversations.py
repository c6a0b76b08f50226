"""Multi-turn conversations the tokenization and loop suites replay. Assistant messages stand
for what the model generated; everything else is appended as a template delta."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

CALCULATOR: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]},
    },
}
SEARCH: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "search",
        "description": "Look a word up.",
        "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]},
    },
}


def _call(call_id: str, name: str, **arguments: Any) -> dict[str, Any]:
    # Ids are 9 alphanumeric characters, the form Mistral's template requires.
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


@dataclass(frozen=True)
class Conversation:
    """One test conversation."""

    name: str
    """Test id."""
    messages: list[dict[str, Any]]
    """Chat messages; the first assistant message starts the generated part."""
    tools: list[dict[str, Any]] | None = field(default=None)
    """OpenAI function schemas rendered into the prompt."""


CONVERSATIONS: tuple[Conversation, ...] = (
    Conversation("single_turn", [
        {"role": "user", "content": "What is 2 + 3?"},
        {"role": "assistant", "content": "2 + 3 = 5."},
    ]),
    Conversation("system_and_two_user_rounds", [
        {"role": "system", "content": "You are a careful math tutor."},
        {"role": "user", "content": "Ann has 3 apples and buys 4 more."},
        {"role": "assistant", "content": "So she has 7 apples."},
        {"role": "user", "content": "And if she eats 2?"},
        {"role": "assistant", "content": "Then 5 are left."},
    ]),
    Conversation("tool_calls_several_rounds", [
        {"role": "system", "content": "Use the tools."},
        {"role": "user", "content": "Compute 12 * 7, then 84 - 9."},
        {"role": "assistant", "content": "", "tool_calls": [_call("calc00001", "calculator", expression="12 * 7")]},
        {"role": "tool", "name": "calculator", "tool_call_id": "calc00001", "content": "84"},
        {"role": "assistant", "content": "Next step.", "tool_calls": [_call("calc00002", "calculator", expression="84 - 9")]},
        {"role": "tool", "name": "calculator", "tool_call_id": "calc00002", "content": "75"},
        {"role": "assistant", "content": "The answer is 75.\n#### 75"},
    ], tools=[CALCULATOR]),
    Conversation("parallel_tool_calls", [
        {"role": "user", "content": "Look up apple and compute 1 + 1."},
        {"role": "assistant", "content": "", "tool_calls": [_call("srch00001", "search", query="apple"),
                                                            _call("calc00001", "calculator", expression="1 + 1")]},
        {"role": "tool", "name": "search", "tool_call_id": "srch00001", "content": "a fruit"},
        {"role": "tool", "name": "calculator", "tool_call_id": "calc00001", "content": "2"},
        {"role": "assistant", "content": "An apple is a fruit and 1 + 1 = 2."},
    ], tools=[CALCULATOR, SEARCH]),
    Conversation("unicode", [
        {"role": "user", "content": "Übersetze: «café» — 東京 🚀 naïve"},
        {"role": "assistant", "content": "Café in 東京 ist gut 🚀 — ça va?"},
        {"role": "user", "content": "Ещё раз, пожалуйста. ∑ x² ≤ π"},
        {"role": "assistant", "content": "Хорошо: ∑ x² ≤ π ✓"},
    ]),
    Conversation("empty_content", [
        {"role": "user", "content": ""},
        {"role": "assistant", "content": ""},
        {"role": "user", "content": "Say something."},
        {"role": "assistant", "content": "Something."},
    ]),
    Conversation("reasoning_content", [
        {"role": "user", "content": "Is 91 prime?"},
        {"role": "assistant", "content": "<think>\n91 = 7 * 13.\n</think>\n\nNo, 91 = 7 * 13."},
        {"role": "user", "content": "And 97?"},
        {"role": "assistant", "content": "<think>\nNo divisor up to 9.\n</think>\n\nYes, 97 is prime."},
    ]),
    Conversation("ends_with_tool_result", [
        {"role": "user", "content": "Compute 6 * 7."},
        {"role": "assistant", "content": "", "tool_calls": [_call("calc00001", "calculator", expression="6 * 7")]},
        {"role": "tool", "name": "calculator", "tool_call_id": "calc00001", "content": "42"},
    ], tools=[CALCULATOR]),
)
