"""The Responses API's stream events, translated from a streamed chat answer's deltas.

:class:`ResponseEvents` turns the deltas of ``chat.completion.chunk`` objects (as
:func:`~agentloop_engines.serving.gateway.live.stream_chat_completion` sends them while the engine
decodes) into the events the ``openai`` SDK's ``responses.create(stream=True)`` and
``responses.stream(...)`` assemble:

* ``response.created`` and ``response.in_progress`` (the response with no output yet);
* reasoning: ``response.output_item.added`` (a ``reasoning`` item), ``response.content_part.added``
  (a ``reasoning_text`` part), ``response.reasoning_text.delta`` ..., and when anything else
  starts, ``response.reasoning_text.done``, ``response.content_part.done``,
  ``response.output_item.done``;
* text: the same for a ``message`` item and its ``output_text`` part
  (``response.output_text.delta`` ... ``response.output_text.done``);
* each tool call, once its block has closed: ``response.output_item.added`` (a
  ``function_call`` item), ``response.function_call_arguments.delta`` and ``.done``,
  ``response.output_item.done``;
* a reply of nothing but the end of its turn: one ``message`` item with an empty
  ``output_text`` (added and done at the end), as the whole response has;
* ``response.completed`` (or ``response.incomplete``) with the whole response object, its
  token-id extension fields included; an answer that fails on the way ends with
  ``response.failed`` and an ``error`` event instead (:meth:`ResponseEvents.failed`).

One item is open at a time, each done before the next is added, as OpenAI streams them. So
text the model wrote after a call (sent when the answer ends, see
:class:`~agentloop_engines.serving.gateway.stream_text.StreamText`) comes as a second message item,
where a non-streamed response has one message before its calls; sent back as input, both
become the same assistant message (consecutive output items join one, see
:mod:`~agentloop_engines.serving.gateway.responses_request`). Every event has a ``sequence_number``
counting from 0. No I/O here: the caller feeds deltas and
sends what comes back.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from agentloop_engines.serving.gateway.responses_output import (
    function_call_item,
    message_item,
    new_id,
    reasoning_item,
)
from agentloop_engines.serving.gateway.stream_errors import stream_error

__all__ = ["ResponseEvents"]


class ResponseEvents:
    """The events of one streamed response, and the assistant message its deltas add up to."""

    def __init__(self) -> None:
        self.sequence = 0
        self.output: list[dict[str, Any]] = []
        """The output items in output order (an open item as it was added, until it is done)."""
        self.content = ""
        self.reasoning = ""
        self.calls: list[dict[str, Any]] = []
        self._open_reasoning: tuple[int, str, int] | None = None  # output index, item id, start in self.reasoning
        self._open_message: tuple[int, str, int] | None = None  # output index, item id, start in self.content

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return event

    def start(self, response: Mapping[str, Any]) -> list[dict[str, Any]]:
        """``response.created`` and ``response.in_progress`` of the in-progress ``response``."""
        return [self._event("response.created", response={**response, "output": []}),
                self._event("response.in_progress", response={**response, "output": []})]

    def feed(self, delta: Mapping[str, Any]) -> list[dict[str, Any]]:
        """The events of one chat ``delta`` (``reasoning_content``, ``content``, ``tool_calls``)."""
        events: list[dict[str, Any]] = []
        if delta.get("reasoning_content"):
            if self._open_reasoning is None:
                events += self._add(reasoning_item(new_id("rs"), "", "in_progress"),
                                    {"type": "reasoning_text", "text": ""})
                index, item_id = len(self.output) - 1, self.output[-1]["id"]
                self._open_reasoning = (index, item_id, len(self.reasoning))
            index, item_id, _ = self._open_reasoning
            self.reasoning += delta["reasoning_content"]
            events.append(self._event("response.reasoning_text.delta", item_id=item_id, output_index=index,
                                      content_index=0, delta=delta["reasoning_content"]))
        if delta.get("content"):
            events += self._close_reasoning("completed")
            if self._open_message is None:
                events += self._add(message_item(new_id("msg"), None, "in_progress"),
                                    {"type": "output_text", "text": "", "annotations": []})
                self._open_message = (len(self.output) - 1, self.output[-1]["id"], len(self.content))
            index, item_id, _ = self._open_message
            self.content += delta["content"]
            events.append(self._event("response.output_text.delta", item_id=item_id, output_index=index,
                                      content_index=0, delta=delta["content"], logprobs=[]))
        for call in delta.get("tool_calls") or ():
            events += self._close_reasoning("completed")
            events += self._close_message("completed")
            events += self._call({k: v for k, v in call.items() if k != "index"})
        return events

    def finish(self, finish_reason: str) -> list[dict[str, Any]]:
        """The events that close the open items once the answer finished with ``finish_reason``."""
        cut = "incomplete" if finish_reason == "length" else "completed"
        events = self._close_reasoning(cut if self._open_message is None and not self.calls else "completed")
        if not self.output:  # nothing but the end of the turn: an empty message, as a whole response has
            events += self._add(message_item(new_id("msg"), None, "in_progress"),
                                {"type": "output_text", "text": "", "annotations": []})
            self._open_message = (len(self.output) - 1, self.output[-1]["id"], len(self.content))
        return [*events, *self._close_message(cut)]

    def done(self, response: Mapping[str, Any]) -> dict[str, Any]:
        """The last event: ``response.completed``, or ``response.incomplete`` for a response that
        was cut (or cancelled)."""
        kind = "response.completed" if response["status"] == "completed" else "response.incomplete"
        return self._event(kind, response=response)

    def failed(self, response: Mapping[str, Any], exc: Exception) -> list[dict[str, Any]]:
        """The last events of a stream whose answer failed with ``exc``: ``response.failed``
        (the response so far, ``status: "failed"`` with its ``error``) and an ``error`` event,
        which also carries the error as an ``error`` object, as the ``openai`` SDK raises it."""
        status, message, code = stream_error(exc)
        kind = "server_error" if status >= 500 else "invalid_request_error"
        failed = {**response, "status": "failed", "error": {"code": code, "message": message}}
        return [self._event("response.failed", response=failed),
                self._event("error", code=code, message=message, param=None,
                            error={"type": kind, "code": code, "message": message})]

    def message(self) -> dict[str, Any]:
        """The chat assistant message the deltas added up to (the one a non-streamed call returns)."""
        message: dict[str, Any] = {"role": "assistant", "content": (self.content or None) if self.calls else self.content}
        if self.reasoning:
            message["reasoning_content"] = self.reasoning
        if self.calls:
            message["tool_calls"] = self.calls
        return message

    def _add(self, item: dict[str, Any], part: dict[str, Any] | None = None) -> list[dict[str, Any]]:
        index = len(self.output)
        self.output.append(item)
        events = [self._event("response.output_item.added", output_index=index, item=item)]
        if part is not None:
            events.append(self._event("response.content_part.added", item_id=item["id"], output_index=index,
                                      content_index=0, part=part))
        return events

    def _close_reasoning(self, status: str) -> list[dict[str, Any]]:
        if self._open_reasoning is None:
            return []
        index, item_id, start = self._open_reasoning
        self._open_reasoning = None
        text = self.reasoning[start:]
        self.output[index] = reasoning_item(item_id, text, status)
        return self._text_done(index, item_id, "response.reasoning_text.done", {"text": text},
                               {"type": "reasoning_text", "text": text})

    def _close_message(self, status: str) -> list[dict[str, Any]]:
        if self._open_message is None:
            return []
        index, item_id, start = self._open_message
        self._open_message = None
        text = self.content[start:]
        self.output[index] = message_item(item_id, text, status)
        return self._text_done(index, item_id, "response.output_text.done", {"text": text, "logprobs": []},
                               {"type": "output_text", "text": text, "annotations": []})

    def _text_done(self, index: int, item_id: str, kind: str, fields: dict[str, Any],
                   part: dict[str, Any]) -> list[dict[str, Any]]:
        """The events that close a text item: its text's ``kind`` done event, its part's, its own."""
        return [self._event(kind, item_id=item_id, output_index=index, content_index=0, **fields),
                self._event("response.content_part.done", item_id=item_id, output_index=index, content_index=0,
                            part=part),
                self._event("response.output_item.done", output_index=index, item=self.output[index])]

    def _call(self, call: dict[str, Any]) -> list[dict[str, Any]]:
        self.calls.append(call)
        item_id = new_id("fc")
        events = self._add(function_call_item(item_id, call, "in_progress", arguments=""))
        index = len(self.output) - 1
        arguments = call["function"]["arguments"]
        self.output[index] = function_call_item(item_id, call)
        return [*events,
                self._event("response.function_call_arguments.delta", item_id=item_id, output_index=index,
                            delta=arguments),
                self._event("response.function_call_arguments.done", item_id=item_id, output_index=index,
                            arguments=arguments),
                self._event("response.output_item.done", output_index=index, item=self.output[index])]
