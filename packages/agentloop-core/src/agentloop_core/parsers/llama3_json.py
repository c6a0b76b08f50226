"""The ``llama3_json`` format of Llama 3.1+: the whole turn is a JSON object
``{"name": ..., "parameters": {...}}`` (optionally after ``<|python_tag|>``), several calls
separated by ``;``."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from agentloop_core.parsers.base import ParseResult, ToolCall, ToolCallError, ToolParser
from agentloop_core.parsers.registry import register_tool_parser

PYTHON_TAG = "<|python_tag|>"
_WHITESPACE = " \t\r\n"


@register_tool_parser("llama3_json")
class Llama3JsonToolParser(ToolParser):
    """Parses a turn that is one or more ``;``-separated JSON call objects.

    A turn that does not start with ``{`` (after an optional ``<|python_tag|>``), or whose first
    JSON object has no ``"name"``, is plain content with no calls. Llama ends a tool-calling
    turn with ``<|eom_id|>`` (expects a tool result) or ``<|eot_id|>``.
    """

    stop_tokens = ("<|eom_id|>", "<|eot_id|>")

    def _parse(self, text: str, tools: Mapping[str, Any] | None) -> ParseResult:
        body = text.strip()
        for token in self.stop_tokens:
            if body.endswith(token):
                body = body[: -len(token)].rstrip()
        tagged = body.startswith(PYTHON_TAG)
        if tagged:
            body = body[len(PYTHON_TAG) :].lstrip()
        if not body.startswith("{"):
            return ParseResult(content=text.strip())
        decoder = json.JSONDecoder()
        calls: list[ToolCall] = []
        errors: list[ToolCallError] = []
        pos = 0
        index = 0
        while pos < len(body):
            try:
                payload, end = decoder.raw_decode(body, pos)
            except (ValueError, RecursionError) as exc:
                if pos == 0 and not tagged:
                    # An untagged turn that merely starts with "{" may be prose, not a call.
                    return ParseResult(content=text.strip())
                errors.append(ToolCallError(body[pos:], "the tool call is not valid JSON "
                                            f"({_json_error(exc)}); write "
                                            '{"name": <tool name>, "parameters": {...}}', "invalid_json"))
                break
            raw = body[pos:end]
            if pos == 0 and not tagged and not (isinstance(payload, dict) and "name" in payload):
                return ParseResult(content=text.strip())
            call = self.build_call(raw, payload, index, tools, ("parameters", "arguments"))
            if isinstance(call, ToolCall):
                calls.append(call)
                index += 1
            else:
                errors.append(call)
            pos = end
            while pos < len(body) and body[pos] in _WHITESPACE:
                pos += 1
            if pos >= len(body):
                break
            if body[pos] != ";":
                errors.append(ToolCallError(body[pos:], "unexpected text after a tool call; separate "
                                            "calls with ';' and write nothing else in a calling turn",
                                            "trailing_text"))
                break
            pos += 1
            while pos < len(body) and body[pos] in _WHITESPACE:
                pos += 1
        return ParseResult(content="", calls=calls, errors=errors)


def _json_error(exc: BaseException) -> str:
    if isinstance(exc, json.JSONDecodeError):
        return f"{exc.msg} at character {exc.pos}"
    return type(exc).__name__


__all__ = ["Llama3JsonToolParser"]
