"""Opaque histories: a conversation whose assistant turns are markers, for delta renders.

A delta is cut from a render of the history plus the new messages, right after the last
assistant turn. Rendering that turn's generated text would let the template move the cut (Qwen3
strips reasoning from earlier turns, gpt-oss refuses channel tags in content, an empty think
block is added to the last turn), so every assistant turn is rendered as a marker no real
conversation contains, and its tool calls (when kept) with a marker as their arguments.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["BASE_CONVERSATION", "args_marker", "opaque_history", "roles", "turn_marker"]

BASE_CONVERSATION: tuple[dict[str, str], ...] = (
    {"role": "user", "content": "Hello."},
    {"role": "assistant", "content": "Hello."},
)
"""The user message and reply a ``short`` delta render puts in front of the last assistant
turn (and the conversation the construction probes render)."""


def turn_marker(index: int) -> str:
    """Stands in for the content of the assistant message at ``index`` in delta renders."""
    return f"\u2063agentloop-turn-{index}-7d1f\u2063"


def args_marker(index: int) -> str:
    """Stands in for the tool call arguments of that message (ASCII: templates JSON-encode it)."""
    return f"agentloop-args-{index}-7d1f"


def opaque_history(history: Sequence[Mapping[str, Any]], new_messages: Sequence[Mapping[str, Any]], *,
                   with_calls: bool) -> list[dict]:
    """``history + new_messages`` with every assistant turn of ``history`` made opaque: content
    replaced by its marker, reasoning fields dropped, and (``with_calls``) its tool calls kept
    with their arguments replaced by a marker; calls not attached are read from the tool
    messages that follow the turn."""
    combined = [*history, *new_messages]
    out: list[dict] = []
    for i, message in enumerate(history):
        if message.get("role") != "assistant":
            out.append(dict(message))
            continue
        turn: dict[str, Any] = {"role": "assistant", "content": turn_marker(i)}
        if with_calls:
            calls = message.get("tool_calls") or _calls_from_results(combined, i)
            if calls:
                turn["tool_calls"] = [_opaque_call(call, i) for call in calls]
        out.append(turn)
    return out + [dict(m) for m in new_messages]


def _opaque_call(call: Mapping[str, Any], index: int) -> dict:
    function = call.get("function", call) if isinstance(call, Mapping) else {}
    opaque: dict[str, Any] = {
        "type": "function",
        "function": {"name": str(function.get("name", "")), "arguments": {"input": args_marker(index)}},
    }
    if call.get("id") is not None:
        opaque["id"] = str(call["id"])
    return opaque


def _calls_from_results(messages: Sequence[Mapping[str, Any]], index: int) -> list[dict]:
    """Calls for the assistant turn at ``index`` from the tool messages right after it (their
    ``name`` and ``tool_call_id``); empty when they name no function."""
    calls = []
    for message in messages[index + 1 :]:
        if message.get("role") != "tool":
            break
        if not message.get("name"):
            return []
        call: dict[str, Any] = {"function": {"name": message["name"]}}
        if message.get("tool_call_id") is not None:
            call["id"] = message["tool_call_id"]
        calls.append(call)
    return calls


def roles(messages: Sequence[Mapping[str, Any]]) -> str:
    """``[user, tool]``: the roles of ``messages``, for error messages."""
    return "[" + ", ".join(str(m.get("role")) for m in messages) + "]"
