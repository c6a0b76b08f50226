"""The ``qwen3_coder`` format: XML-style calls, as Qwen3-Coder writes them::

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    <parameter=days>
    3
    </parameter>
    </function>
    </tool_call>

Parameter values are raw text, not JSON, so a value is typed by the tool's schema: a
``string`` parameter keeps its text (one leading and one trailing newline removed, as the chat
template writes them), any other declared type is decoded as JSON (booleans also as
``True``/``False``). A parameter the schema does not type stays text.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from agentloop_core.parsers.base import ParseResult, ToolCall, ToolCallError, ToolParser, tool_parameters
from agentloop_core.parsers.registry import register_tool_parser

OPEN = "<tool_call>"
CLOSE = "</tool_call>"
_FUNCTION = re.compile(r"<function=([^>\n]*)>")
_PARAMETER = re.compile(r"<parameter=([^>\n]*)>")
_FUNCTION_CLOSE = "</function>"
_PARAMETER_CLOSE = "</parameter>"


@register_tool_parser("qwen3_coder")
class Qwen3CoderToolParser(ToolParser):
    """Parses ``<tool_call><function=NAME><parameter=KEY>value</parameter>...</function></tool_call>``
    blocks, any number per turn; text outside the blocks is the turn's content. The turn ends
    with the model's EOS (``<|im_end|>``)."""

    stop_tokens = ()
    call_openings = (OPEN,)

    def _parse(self, text: str, tools: Mapping[str, Any] | None) -> ParseResult:
        content: list[str] = []
        calls: list[ToolCall] = []
        errors: list[ToolCallError] = []
        pos = 0
        while True:
            start = text.find(OPEN, pos)
            if start < 0:
                content.append(text[pos:])
                break
            content.append(text[pos:start])
            end = text.find(CLOSE, start + len(OPEN))
            if end < 0:
                errors.append(ToolCallError(text[start:], f"{OPEN} is never closed; end each call with {CLOSE}",
                                            "unclosed_tag"))
                break
            raw = text[start : end + len(CLOSE)]
            pos = end + len(CLOSE)
            call = self._call(raw, text[start + len(OPEN) : end], len(calls), tools)
            if isinstance(call, ToolCall):
                calls.append(call)
            else:
                errors.append(call)
        return ParseResult(content="".join(content).strip(), calls=calls, errors=errors)

    def _call(self, raw: str, body: str, index: int, tools: Mapping[str, Any] | None) -> ToolCall | ToolCallError:
        match = _FUNCTION.search(body)
        if match is None or not match.group(1).strip():
            return ToolCallError(raw, "the tool call names no function; write <function=NAME> inside "
                                 f"{OPEN}", "missing_name")
        name = match.group(1).strip()
        close = body.find(_FUNCTION_CLOSE, match.end())
        if close < 0:
            return ToolCallError(raw, f"<function={name}> is never closed; end it with {_FUNCTION_CLOSE}",
                                 "unclosed_tag", name)
        types = _parameter_types(tools.get(name) if tools is not None else None)
        arguments: dict[str, Any] = {}
        inner = body[match.end() : close]
        pos = 0
        while (param := _PARAMETER.search(inner, pos)) is not None:
            key = param.group(1).strip()
            value_end = inner.find(_PARAMETER_CLOSE, param.end())
            if value_end < 0:
                return ToolCallError(raw, f"<parameter={key}> is never closed; end it with {_PARAMETER_CLOSE}",
                                     "unclosed_tag", name)
            value = _typed(inner[param.end() : value_end], types.get(key))
            if isinstance(value, ToolCallError):
                return ToolCallError(raw, f"parameter {key!r} of {name!r}: {value.reason}", "invalid_arguments", name)
            arguments[key] = value
            pos = value_end + len(_PARAMETER_CLOSE)
        return self.build_call(raw, {"name": name, "arguments": arguments}, index, tools, ("arguments",))


def _parameter_types(spec: Any) -> dict[str, Any]:
    """Parameter name -> its schema ``type`` (a string, a list of them, or None)."""
    parameters = tool_parameters(spec) or {}
    properties = parameters.get("properties")
    if not isinstance(properties, Mapping):
        return {}
    return {k: v.get("type") for k, v in properties.items() if isinstance(v, Mapping)}


def _typed(text: str, kind: Any) -> Any:
    """The value of one parameter, typed by its schema type."""
    value = text.removeprefix("\n").removesuffix("\n")
    kinds = set(kind) if isinstance(kind, list) else {kind}
    if kind is None or "string" in kinds:
        return value
    if "boolean" in kinds and value.strip() in ("True", "False"):
        return value.strip() == "True"
    try:
        return json.loads(value)
    except (ValueError, RecursionError):
        return ToolCallError(text, f"expected a {'/'.join(str(k) for k in sorted(kinds, key=str))} written as JSON, "
                             f"got {value.strip()[:40]!r}")


__all__ = ["Qwen3CoderToolParser"]
