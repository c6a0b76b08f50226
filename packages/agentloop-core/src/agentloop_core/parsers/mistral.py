"""The ``mistral`` format of Mistral Nemo and the Mistral 7B v0.3 family: ``[TOOL_CALLS]``
followed by a JSON list of ``{"name": ..., "arguments": {...}, "id": "<9 alphanumerics>"}``.

The chat template renders an assistant tool-call turn as ``[TOOL_CALLS][...]</s>``: calls are
the whole turn and EOS ends it, so no extra stop token is needed. Older variants leave out
``id``; ``arguments`` may be an object or a JSON string. ``[TOOL_CALLS]`` is a special token,
so the text must be decoded with special tokens kept
(:attr:`MistralToolParser.needs_special_tokens`).

Newer Mistral tokenizers (v11+: ``[TOOL_CALLS]name[ARGS]{...}``) write a different format,
which this parser reports as invalid JSON.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Mapping
from typing import Any

from agentloop_core.parsers.base import ParseResult, ToolCall, ToolCallError, ToolParser, json_error
from agentloop_core.parsers.registry import register_tool_parser

TOOL_CALLS = "[TOOL_CALLS]"
EOS = "</s>"
_WHITESPACE = " \t\r\n"
_CALL_ID = re.compile(r"[A-Za-z0-9]{9}")
"""A tool call id the Mistral chat template accepts (it checks the length; the tokenizer's own
validation asks for letters and digits)."""
_BASE36 = "0123456789abcdefghijklmnopqrstuvwxyz"
_EXAMPLE = '[TOOL_CALLS][{"name": <tool name>, "arguments": {...}}]'


@register_tool_parser("mistral")
class MistralToolParser(ToolParser):
    """Parses ``[TOOL_CALLS]`` JSON lists; text before the first one is the turn's content.

    Each list item is decoded on its own, so a broken item (truncated JSON, unknown tool) is an
    error while the items before it are still usable calls. Calls get the same per-turn ids
    (``call_0``, ``call_1``...) as every other parser; the ``id`` the model writes is kept as
    :attr:`ToolCall.model_id` when it is 9 ASCII letters or digits (the only ids the chat template
    accepts), so the tool result answers the call under the model's own id. For calls without
    one, :meth:`make_call_id` makes a 9-character id.
    """

    stop_tokens = ()
    needs_special_tokens = True

    def make_call_id(self, turn: int, index: int, call: ToolCall | None = None) -> str:
        """``call`` + the turn in 3 and the index in 2 base-36 digits (``call00100`` for the first
        call of turn 1): 9 letters and digits, as the template demands, the same on every run, and
        distinct for up to 1296 calls a turn and 46655 turns."""
        return "call" + _base36(turn, 3) + _base36(index, 2)

    def _parse(self, text: str, tools: Mapping[str, Any] | None) -> ParseResult:
        body = text.rstrip()
        if body.endswith(EOS):  # a caller that decoded the whole turn, EOS included
            body = body[: -len(EOS)]
        start = body.find(TOOL_CALLS)
        if start < 0:
            return ParseResult(content=body.strip())
        calls: list[ToolCall] = []
        errors: list[ToolCallError] = []
        while start >= 0:
            # Decoding runs past later [TOOL_CALLS] text: a string argument may contain it.
            next_tag = body.find(TOOL_CALLS, start + len(TOOL_CALLS))
            items, end, failure = _decode_list(body, _skip_space(body, start + len(TOOL_CALLS)),
                                               len(body) if next_tag < 0 else next_tag)
            for raw, payload in items:
                call = self.build_call(raw, payload, len(calls), tools, ("arguments",))
                if isinstance(call, ToolCall):
                    model_id = payload.get("id")
                    if isinstance(model_id, str) and _CALL_ID.fullmatch(model_id):
                        call = dataclasses.replace(call, model_id=model_id)
                    calls.append(call)
                else:
                    errors.append(call)
            if failure is not None:
                errors.append(failure)
            elif not items:
                errors.append(ToolCallError(body[start:end], f"{TOOL_CALLS} is followed by an empty list; write "
                                            f"{_EXAMPLE}", "missing_name"))
            # After broken JSON the next tag may start inside the text that failed to decode.
            following = body.find(TOOL_CALLS, end) if failure is None else next_tag
            stop = following if following >= 0 else len(body)
            rest = _skip_space(body, end)
            if failure is None and rest < stop:
                errors.append(ToolCallError(body[rest:stop], "unexpected text after the tool calls; end the "
                                            "turn after the closing ]", "trailing_text"))
            start = following
        return ParseResult(content=body[: body.find(TOOL_CALLS)].strip(), calls=calls, errors=errors)


def _base36(value: int, width: int) -> str:
    """``value`` modulo ``36**width`` in ``width`` base-36 digits."""
    value %= 36**width
    digits = []
    for _ in range(width):
        value, digit = divmod(value, 36)
        digits.append(_BASE36[digit])
    return "".join(reversed(digits))


def _decode_list(body: str, pos: int, block_end: int) -> tuple[list[tuple[str, Any]], int, ToolCallError | None]:
    """Decode the JSON list (or lone call object) at ``pos``, item by item; ``block_end`` (the
    next ``[TOOL_CALLS]``) only bounds the text quoted in errors.

    Returns:
        ``(items, end, failure)``: each decoded item with its text, where decoding stopped,
        and the error that stopped it early (None when the list closed).
    """
    decoder = json.JSONDecoder()
    if pos >= len(body) or body[pos] not in "[{":
        return [], pos, ToolCallError(_quote(body, pos, block_end) or TOOL_CALLS, f"{TOOL_CALLS} must be followed by a "
                                      f"JSON list of calls; write {_EXAMPLE}", "invalid_json")
    if body[pos] == "{":  # a lone call object without the list: accepted
        try:
            payload, end = decoder.raw_decode(body, pos)
        except (ValueError, RecursionError) as exc:
            return [], pos, _invalid(_quote(body, pos, block_end), exc)
        return [(body[pos:end], payload)], end, None
    items: list[tuple[str, Any]] = []
    item_start = _skip_space(body, pos + 1)
    if body.startswith("]", item_start):
        return items, item_start + 1, None
    while True:
        try:
            payload, end = decoder.raw_decode(body, item_start)
        except (ValueError, RecursionError) as exc:
            return items, item_start, _invalid(_quote(body, item_start, block_end), exc)
        items.append((body[item_start:end], payload))
        after = _skip_space(body, end)
        if body.startswith("]", after):
            return items, after + 1, None
        if not body.startswith(",", after):
            return items, after, ToolCallError(_quote(body, pos, block_end), f"the {TOOL_CALLS} list is never closed; "
                                               "separate calls with ',' and end the list with ]", "unclosed_tag")
        item_start = _skip_space(body, after + 1)


def _quote(body: str, start: int, block_end: int) -> str:
    """The text of a broken block; past ``block_end`` when the next tag sits inside it."""
    return body[start:block_end] if block_end > start else body[start : start + 200]


def _invalid(raw: str, exc: BaseException) -> ToolCallError:
    return ToolCallError(raw, f"the tool call is not valid JSON ({json_error(exc)}); write {_EXAMPLE}", "invalid_json")


def _skip_space(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in _WHITESPACE:
        pos += 1
    return pos


__all__ = ["MistralToolParser"]
