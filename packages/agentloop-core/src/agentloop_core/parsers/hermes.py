"""The ``hermes`` format: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks,
any number per turn, as Qwen2.5/Qwen3 and Hermes models write them."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from agentloop_core.parsers.base import ParseResult, ToolCall, ToolCallError, ToolParser
from agentloop_core.parsers.registry import register_tool_parser

OPEN = "<tool_call>"
CLOSE = "</tool_call>"
_MAX_CLOSE_CANDIDATES = 8


@register_tool_parser("hermes")
class HermesToolParser(ToolParser):
    """Parses ``<tool_call>`` JSON blocks; text outside the blocks is the turn's content.

    The turn ends with the model's EOS (``<|im_end|>``), so no extra stop token is needed and
    several calls fit in one turn.
    """

    stop_tokens = ()
    call_openings = (OPEN,)

    def _parse(self, text: str, tools: Mapping[str, Any] | None) -> ParseResult:
        content: list[str] = []
        calls: list[ToolCall] = []
        errors: list[ToolCallError] = []
        pos = 0
        index = 0
        while True:
            start = text.find(OPEN, pos)
            segment = text[pos:] if start < 0 else text[pos:start]
            if CLOSE in segment:
                errors.append(ToolCallError(CLOSE, f"found {CLOSE} without an opening {OPEN}; wrap each "
                                            f"call as {OPEN}{{...}}{CLOSE}", "stray_tag"))
                segment = segment.replace(CLOSE, "")
            content.append(segment)
            if start < 0:
                break
            body_start = start + len(OPEN)
            end = text.find(CLOSE, body_start)
            if end < 0:
                errors.append(ToolCallError(text[start:], f"{OPEN} is never closed; end each call with "
                                            f"{CLOSE}", "unclosed_tag"))
                break
            payload, end, failure = _decode_block(text, body_start, end)
            raw = text[start : end + len(CLOSE)]
            pos = end + len(CLOSE)
            if failure is not None:
                if OPEN in text[body_start:end]:
                    errors.append(ToolCallError(raw, f"{OPEN} blocks cannot be nested; write one JSON "
                                                "object per block", "nested_tag"))
                else:
                    errors.append(ToolCallError(raw, f"the tool call is not valid JSON ({failure}); write "
                                                '{"name": <tool name>, "arguments": {...}}', "invalid_json"))
                continue
            call = self.build_call(raw, payload, index, tools, ("arguments", "parameters"))
            if isinstance(call, ToolCall):
                calls.append(call)
                index += 1
            else:
                errors.append(call)
        return ParseResult(content="".join(content).strip(), calls=calls, errors=errors)


def _decode_block(text: str, body_start: int, end: int) -> tuple[object, int, str | None]:
    """Decode the JSON between ``body_start`` and the first ``</tool_call>`` at ``end``.

    A string argument may itself contain ``</tool_call>`` (code, docs about tool calling), so
    when the first closing tag cuts the JSON short, later closing tags are tried too.

    Returns:
        ``(payload, end_of_block, None)`` on success, else ``(None, first_end, reason)``.
    """
    first_end = end
    failure: str | None = None
    for _ in range(_MAX_CLOSE_CANDIDATES):
        try:
            return json.loads(text[body_start:end]), end, None
        except (ValueError, RecursionError) as exc:
            if failure is None:
                failure = _json_error(exc)
        end = text.find(CLOSE, end + len(CLOSE))
        if end < 0:
            break
    return None, first_end, failure


def _json_error(exc: BaseException) -> str:
    if isinstance(exc, json.JSONDecodeError):
        return f"{exc.msg} at character {exc.pos}"
    return type(exc).__name__


__all__ = ["HermesToolParser"]
