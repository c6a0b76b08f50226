"""The ``gpt_oss`` (alias ``harmony``) format of OpenAI's gpt-oss models.

A turn is a sequence of harmony messages, each ``<header><|message|><body><end token>``, the
next one opening with ``<|start|>``. The generation prompt ends with ``<|start|>assistant``, so
the first header has no ``<|start|>`` of its own::

    <|channel|>analysis<|message|>The user wants the weather.<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>

A message whose header names a recipient (``to=functions.get_weather``) is a tool call; its
body is the JSON arguments. The model may put the recipient before the channel (as the chat
template renders history: ``assistant to=functions.get_weather<|channel|>commentary json``)
or after it; both are read. Every delimiter is a special token, so the text must be decoded
with special tokens kept (:attr:`GptOssToolParser.needs_special_tokens`).

Decoded text cannot tell an end token from ordinary tokens that spell it, so arguments holding
the text ``<|call|>``, ``<|end|>``, ``<|return|>`` or ``<|start|>`` are cut there (and reported
as invalid JSON). The engine stops at the ``<|call|>`` token, so the token itself never lands
inside arguments.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from agentloop_core.parsers.base import ParseResult, ToolCall, ToolCallError, ToolParser, json_error
from agentloop_core.parsers.registry import register_tool_parser

START = "<|start|>"
MESSAGE = "<|message|>"
CHANNEL = "<|channel|>"
CONSTRAIN = "<|constrain|>"
CALL = "<|call|>"
END = "<|end|>"
RETURN = "<|return|>"
FUNCTIONS = "functions."

_DELIMITER = re.compile(r"<\|(start|message|call|end|return)\|>")
_SPECIAL = re.compile(r"<\|[a-z_]+\|>")
_RECIPIENT = re.compile(r"\bto=([^\s<]*)")
_CHANNEL = re.compile(re.escape(CHANNEL) + r"\s*([^\s<]*)")
_ENDS = (CALL, END, RETURN)
_HIDDEN_CHANNELS = frozenset({"analysis"})
"""Channels whose text is reasoning, not content a user would see."""


@dataclass(frozen=True)
class _Message:
    header: str
    """Text before ``<|message|>`` (role, channel, recipient, content type)."""
    body: str
    """Text between ``<|message|>`` and the end token."""
    end: str | None
    """The token that closed the message; None when the turn ended (or a new message began)
    before any end token."""
    raw: str
    """The message as written, for errors."""


@register_tool_parser("gpt_oss", aliases=("harmony",))
class GptOssToolParser(ToolParser):
    """Parses harmony messages; a message with a recipient is a tool call.

    Stops at ``<|call|>`` (the model hands over to the tool) and ``<|return|>`` (the final
    answer is done; gpt-oss's EOS, listed so the turn ends even where the tokenizer's EOS is
    ``<|endoftext|>``). ``<|end|>`` is not a stop token: it closes each message inside a turn,
    and stopping there would cut the turn after its reasoning, before the call. As ``<|call|>``
    stops the turn, a turn normally holds one call; a turn with several (a call closed with
    ``<|end|>``) gives them all, in order.

    Content is the text of the messages that are neither calls nor reasoning (the ``final``
    channel, commentary preambles, text outside any message); ``analysis`` bodies are left out.
    """

    stop_tokens = (CALL, RETURN)
    needs_special_tokens = True

    def _parse(self, text: str, tools: Mapping[str, Any] | None) -> ParseResult:
        content: list[str] = []
        calls: list[ToolCall] = []
        errors: list[ToolCallError] = []
        for item in _split(text):
            if isinstance(item, str):
                loose = _orphan(item)
                if isinstance(loose, ToolCallError):
                    errors.append(loose)
                elif loose:
                    content.append(loose)
                continue
            recipient = _recipient(item.header)
            if recipient is None:
                if _channel(item.header) not in _HIDDEN_CHANNELS:
                    content.append(_SPECIAL.sub("", item.body).strip())
                continue
            call = self._call(item, recipient, len(calls), tools)
            if isinstance(call, ToolCall):
                calls.append(call)
            else:
                errors.append(call)
        return ParseResult(content="\n".join(c for c in content if c).strip(), calls=calls, errors=errors)

    def _call(self, message: _Message, recipient: str, index: int,
              tools: Mapping[str, Any] | None) -> ToolCall | ToolCallError:
        name = _tool_name(recipient)
        if not name:
            return ToolCallError(message.raw, f"the tool call names no tool; address it as to={FUNCTIONS}<tool name>",
                                 "missing_name")
        if message.end is None:
            return ToolCallError(message.raw, f"the call to {recipient} is never closed; end each tool call with "
                                 f"{CALL}", "unclosed_tag", name)
        body = message.body.strip()
        try:
            arguments = json.loads(body) if body else {}
        except (ValueError, RecursionError) as exc:
            return ToolCallError(message.raw, f"the arguments of the call to {recipient} are not valid JSON "
                                 f"({json_error(exc)}); write {MESSAGE}{{...}}{CALL} with a JSON object",
                                 "invalid_json", name)
        return self.build_call(message.raw, {"name": name, "arguments": arguments}, index, tools, ("arguments",))


def _split(text: str) -> list[_Message | str]:
    """The turn's messages in order, and the text found outside any message.

    The first header starts at the beginning of the text (the generation prompt opened it).
    A ``<|message|>`` inside a body is kept as body text; an end token before any
    ``<|message|>`` closes a header that never got a body, which comes back as loose text.
    """
    items: list[_Message | str] = []
    pos = raw_start = 0  # header start; raw_start also covers the <|start|> before it
    header_end: int | None = None
    for match in _DELIMITER.finditer(text):
        token = match.group(0)
        if header_end is None:
            if token == MESSAGE:
                header_end = match.start()
                continue
            # <|start|> opens the next header; an end token closes a header that had no body.
            items.append(text[pos : match.start() if token == START else match.end()])
            raw_start = match.start() if token == START else match.end()
        elif token in _ENDS or token == START:
            end = token if token in _ENDS else None
            stop = match.end() if end is not None else match.start()
            items.append(_Message(text[pos:header_end], text[header_end + len(MESSAGE) : match.start()], end,
                                  text[raw_start:stop]))
            raw_start = match.end() if end is not None else match.start()
            header_end = None
        else:
            continue
        pos = match.end()
    if header_end is not None:
        items.append(_Message(text[pos:header_end], text[header_end + len(MESSAGE) :], None, text[raw_start:]))
    else:
        items.append(text[pos:])
    return items


def _orphan(text: str) -> str | ToolCallError:
    """Text outside any message: content, unless it is a tool-call header that lost its body."""
    recipient = _recipient(text)
    if recipient is not None:
        return ToolCallError(text.strip(), f"the call to {recipient} has no {MESSAGE}; write the header, then "
                             f"{MESSAGE}{{...arguments}}{CALL}", "unclosed_tag", _tool_name(recipient) or None)
    return _SPECIAL.sub("", text).strip()


def _recipient(header: str) -> str | None:
    """The tool a header addresses (``functions.get_weather``), or None. ``to=assistant`` (a
    tool's reply the model wrote itself) and ``to=user`` address no tool."""
    match = _RECIPIENT.search(header)
    if match is None or match.group(1) in ("assistant", "user"):
        return None
    return match.group(1)


def _tool_name(recipient: str) -> str:
    """``get_weather`` for ``functions.get_weather``; a built-in's recipient (``python``) as is."""
    return recipient[len(FUNCTIONS) :] if recipient.startswith(FUNCTIONS) else recipient


def _channel(header: str) -> str | None:
    match = _CHANNEL.search(header)
    return match.group(1) if match else None


# Public names for the ``gpt_oss`` reasoning parser (agentloop_core.reasoning.harmony), which
# splits the same messages.
split_messages = _split
message_channel = _channel
message_recipient = _recipient
HIDDEN_CHANNELS = _HIDDEN_CHANNELS
SPECIAL = _SPECIAL

__all__ = ["GptOssToolParser"]
