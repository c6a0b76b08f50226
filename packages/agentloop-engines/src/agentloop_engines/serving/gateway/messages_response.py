"""Chat completions answers as Anthropic Messages: the ``message`` object and its stream events.

:func:`message_body` turns a ``chat.completion`` into a ``message``; :class:`MessageEvents`
turns the chunks of a streamed one into the events the ``anthropic`` SDK assembles
(``message_start``, then per content block ``content_block_start``, its deltas and
``content_block_stop``, then ``message_delta`` and ``message_stop``). Content comes in
Anthropic's order: a ``thinking`` block (when the request enabled thinking), the text, then
one ``tool_use`` block per call. The exact tokens ride along as extension fields, top-level in
the message and in the ``message_delta`` event: ``prompt_token_ids``, ``token_ids``,
``token_logprobs`` (``tool_call_errors`` when a call could not be parsed, ``session_id`` in a
session).

Finish reasons map to stop reasons: ``tool_calls`` is ``tool_use``, ``length`` is
``max_tokens``, a stop string is ``stop_sequence`` (with the string), and the rest
(the end of the turn, or a generation the trainer aborted) is ``end_turn``. Prompt caching
does not exist here, so its usage counts are 0. No I/O here.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

__all__ = ["MessageEvents", "message_body", "stop_reason"]

_EXTENSIONS = ("token_ids", "token_logprobs", "tool_call_errors")


def stop_reason(finish_reason: str, stop_sequence: str | None) -> str:
    """The Messages ``stop_reason`` of a chat ``finish_reason`` (``stop_sequence``: the stop
    string that ended the generation, or None)."""
    if finish_reason == "tool_calls":
        return "tool_use"
    if finish_reason == "length":
        return "max_tokens"
    return "stop_sequence" if stop_sequence is not None else "end_turn"


def _message_id(chat_id: str) -> str:
    # The chat id's random part, so the message and the recorded chat response name each other.
    return "msg_" + chat_id.split("-", 1)[-1]


def _usage(input_tokens: int, output_tokens: int) -> dict[str, int]:
    return {"input_tokens": input_tokens, "output_tokens": output_tokens, "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": 0}


def _tool_input(arguments: str) -> dict[str, Any]:
    """A call's JSON arguments as the ``input`` object (the gateway's parser wrote them from one)."""
    value = json.loads(arguments) if arguments.strip() else {}
    return value if isinstance(value, dict) else {"input": value}


def message_body(chat: Mapping[str, Any], *, thinking: bool, omit_thinking: bool = False,
                 stop_sequence: str | None = None) -> dict[str, Any]:
    """The ``message`` answering a request, from the ``chat.completion`` that answered its chat body.

    Args:
        chat: The chat completion (with the gateway's extension fields).
        thinking: The request enabled thinking: the reasoning becomes a ``thinking`` block.
        omit_thinking: ``thinking.display`` was ``omitted``: the block's text is left out.
        stop_sequence: The stop string that ended the generation, or None.
    """
    choice = chat["choices"][0]
    message = choice["message"]
    content: list[dict[str, Any]] = []
    if thinking and message.get("reasoning_content"):
        content.append({"type": "thinking", "thinking": "" if omit_thinking else message["reasoning_content"],
                        "signature": ""})
    if message.get("content"):
        content.append({"type": "text", "text": message["content"]})
    for call in message.get("tool_calls") or ():
        function = call["function"]
        content.append({"type": "tool_use", "id": call["id"], "name": function["name"],
                        "input": _tool_input(function["arguments"])})
    reason = stop_reason(choice["finish_reason"], stop_sequence)
    body: dict[str, Any] = {
        "id": _message_id(chat["id"]), "type": "message", "role": "assistant", "model": chat["model"],
        "content": content, "stop_reason": reason,
        "stop_sequence": stop_sequence if reason == "stop_sequence" else None,
        "usage": _usage(chat["usage"]["prompt_tokens"], chat["usage"]["completion_tokens"]),
        "prompt_token_ids": chat.get("prompt_token_ids"),
        **{k: choice[k] for k in _EXTENSIONS if k in choice},
    }
    if "session_id" in chat:
        body["session_id"] = chat["session_id"]
    return body


class MessageEvents:
    """The Messages stream events of one streamed chat completion.

    Feed it the chunks' deltas in order (:meth:`feed`) after :meth:`start`, then the finish chunk
    (:meth:`finish`). A change of kind (reasoning, text, a new tool call) closes the open
    content block and opens the next, so the blocks come in the order the chunks do.

    Args:
        thinking: The request enabled thinking: reasoning deltas become a ``thinking`` block;
            else they are dropped (as the whole answer's reasoning is).
        omit_thinking: ``thinking.display`` was ``omitted``: the block carries no text.
        session_id: The session the call is recorded in, echoed in ``message_delta``.
    """

    def __init__(self, *, thinking: bool, omit_thinking: bool = False, session_id: str | None = None) -> None:
        self.thinking = thinking
        self.omit_thinking = omit_thinking
        self.session_id = session_id
        self.started = False
        self.index = -1
        self.open: str | None = None

    def start(self, chunk: Mapping[str, Any]) -> dict[str, Any]:
        """The ``message_start`` event, from the stream's first chunk. Its ``input_tokens`` is
        the chunk's ``prompt_tokens`` extension (the prompt's length, which the gateway's chat
        stream sends the Messages API), else 0 until ``message_delta`` reports the count."""
        self.started = True
        usage = _usage(int(chunk.get("prompt_tokens") or 0), 0)
        return {"type": "message_start", "message": {
            "id": _message_id(chunk["id"]), "type": "message", "role": "assistant", "model": chunk["model"],
            "content": [], "stop_reason": None, "stop_sequence": None, "usage": usage}}

    def feed(self, delta: Mapping[str, Any]) -> list[dict[str, Any]]:
        """The events of one chunk's ``delta`` (``reasoning_content``, ``content``, ``tool_calls``)."""
        events: list[dict[str, Any]] = []
        if delta.get("reasoning_content") and self.thinking:
            if self.open != "thinking":
                events += self._open("thinking", {"type": "thinking", "thinking": "", "signature": ""})
            if not self.omit_thinking:
                events.append(self._delta({"type": "thinking_delta", "thinking": delta["reasoning_content"]}))
        if delta.get("content"):
            if self.open != "text":
                events += self._open("text", {"type": "text", "text": ""})
            events.append(self._delta({"type": "text_delta", "text": delta["content"]}))
        for call in delta.get("tool_calls") or ():
            function = call.get("function") or {}
            if call.get("id"):  # a new call; a delta without an id continues the open one's arguments
                events += self._open("tool_use", {"type": "tool_use", "id": call["id"], "name": function.get("name"),
                                                  "input": {}})
            if function.get("arguments") and self.open == "tool_use":
                events.append(self._delta({"type": "input_json_delta", "partial_json": function["arguments"]}))
        return events

    def finish(self, chunk: Mapping[str, Any], stop_sequence: str | None) -> list[dict[str, Any]]:
        """The events that end the stream, from the chat stream's finish chunk (its finish
        reason and token-id extension fields): the last block's stop, ``message_delta``,
        ``message_stop``."""
        choice = chunk["choices"][0]
        events = self._close()
        reason = stop_reason(choice["finish_reason"], stop_sequence)
        prompt_ids = chunk.get("prompt_token_ids") or []
        delta: dict[str, Any] = {
            "type": "message_delta",
            "delta": {"stop_reason": reason, "stop_sequence": stop_sequence if reason == "stop_sequence" else None},
            "usage": _usage(len(prompt_ids), len(choice.get("token_ids") or ())),
            "prompt_token_ids": chunk.get("prompt_token_ids"),
            **{k: choice[k] for k in _EXTENSIONS if k in choice},
        }
        if self.session_id is not None:
            delta["session_id"] = self.session_id
        return [*events, delta, {"type": "message_stop"}]

    def _delta(self, delta: dict[str, Any]) -> dict[str, Any]:
        return {"type": "content_block_delta", "index": self.index, "delta": delta}

    def _open(self, kind: str, block: dict[str, Any]) -> list[dict[str, Any]]:
        events = self._close()
        self.index += 1
        self.open = kind
        return [*events, {"type": "content_block_start", "index": self.index, "content_block": block}]

    def _close(self) -> list[dict[str, Any]]:
        if self.open is None:
            return []
        events = []
        if self.open == "thinking":  # Anthropic signs its thinking; the gateway's is unsigned
            events.append(self._delta({"type": "signature_delta", "signature": ""}))
        events.append({"type": "content_block_stop", "index": self.index})
        self.open = None
        return events
