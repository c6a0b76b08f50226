"""OpenAI response bodies and the server-sent event chunks that stream them.

Over HTTP a streamed answer is sent as it is generated (:mod:`~agentloop_engines.serving.gateway.live`);
:meth:`GatewayResponse.chunks` cuts a finished response into the same chunks the OpenAI SDK
assembles (role, content, one tool call at a time, the finish reason, usage), for in-process
callers. Either is followed by ``data: [DONE]``. The exact tokens ride along as extension
fields: top-level ``prompt_token_ids``, and ``token_ids`` / ``token_logprobs`` in the choice (in
the last chunk when streaming), next to vLLM's ``stop_reason`` (the stop string that ended the
generation, else None).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from agentloop_engines.serving.gateway.recorder import RecordedCall
from agentloop_engines.serving.gateway.stream_errors import openai_error_chunk

__all__ = ["GatewayResponse", "chat_chunks", "completion_chunks", "final_chunks", "sse", "sse_events", "sse_live",
           "stream_head"]

_EXTENSIONS = ("stop_reason", "token_ids", "token_logprobs", "tool_call_errors")


def _chunk(body: Mapping[str, Any], obj: str, choice: dict[str, Any]) -> dict[str, Any]:
    return {"id": body["id"], "object": obj, "created": body["created"], "model": body["model"],
            "choices": [{"index": 0, **choice}]}


def stream_head(prefix: str, obj: str, model: str) -> dict[str, Any]:
    """The fields every chunk of one live stream shares (``id``, ``object``, ``created``,
    ``model``), before its response body exists."""
    return {"id": f"{prefix}-{uuid.uuid4().hex}", "object": obj, "created": int(time.time()), "model": model}


def final_chunks(body: Mapping[str, Any], obj: str, choice: dict[str, Any], include_usage: bool) -> Iterator[dict]:
    """The finish chunk of ``body`` (``choice`` plus its finish reason and the token-id
    extension fields) and, with ``include_usage``, the usage chunk."""
    full = body["choices"][0]
    last = _chunk(body, obj, {**choice, "finish_reason": full["finish_reason"],
                              **{k: full[k] for k in _EXTENSIONS if k in full}})
    last["prompt_token_ids"] = body.get("prompt_token_ids")
    yield last
    if include_usage:
        usage = _chunk(body, obj, {})
        usage["choices"] = []
        usage["usage"] = body["usage"]
        yield usage


def chat_chunks(body: Mapping[str, Any], include_usage: bool = False) -> Iterator[dict[str, Any]]:
    """The ``chat.completion.chunk`` objects that stream the ``chat.completion`` ``body``."""
    obj = "chat.completion.chunk"
    choice = body["choices"][0]
    message = choice["message"]
    yield _chunk(body, obj, {"delta": {"role": "assistant", "content": ""}, "logprobs": None,
                             "finish_reason": None})
    if message.get("reasoning_content"):
        yield _chunk(body, obj, {"delta": {"reasoning_content": message["reasoning_content"]}, "logprobs": None,
                                 "finish_reason": None})
    if message.get("content"):
        yield _chunk(body, obj, {"delta": {"content": message["content"]}, "logprobs": choice.get("logprobs"),
                                 "finish_reason": None})
    for i, call in enumerate(message.get("tool_calls") or ()):
        function = call["function"]
        yield _chunk(body, obj, {"delta": {"tool_calls": [{
            "index": i, "id": call["id"], "type": "function",
            "function": {"name": function["name"], "arguments": ""}}]}, "finish_reason": None})
        yield _chunk(body, obj, {"delta": {"tool_calls": [{
            "index": i, "function": {"arguments": function["arguments"]}}]}, "finish_reason": None})
    yield from final_chunks(body, obj, {"delta": {}, "logprobs": None}, include_usage)


def completion_chunks(body: Mapping[str, Any], include_usage: bool = False) -> Iterator[dict[str, Any]]:
    """The ``text_completion`` chunks that stream the ``text_completion`` ``body``."""
    obj = "text_completion"
    choice = body["choices"][0]
    if choice["text"]:
        yield _chunk(body, obj, {"text": choice["text"], "logprobs": choice.get("logprobs"), "finish_reason": None})
    yield from final_chunks(body, obj, {"text": "", "logprobs": None}, include_usage)


def sse(chunks: Iterator[Mapping[str, Any]]) -> Iterator[bytes]:
    """Server-sent events: one ``data:`` line per chunk, then ``data: [DONE]``."""
    for chunk in chunks:
        yield b"data: " + json.dumps(chunk, ensure_ascii=False).encode() + b"\n\n"
    yield b"data: [DONE]\n\n"


async def sse_events(events: AsyncIterator[Mapping[str, Any]]) -> AsyncIterator[bytes]:
    """Server-sent events of typed events (the Responses and Messages APIs): an ``event:`` line
    naming each event's ``type``, its ``data:`` line, and no ``[DONE]`` (these streams end with
    their own last event)."""
    async for event in events:
        yield (b"event: " + str(event["type"]).encode() + b"\ndata: "
               + json.dumps(event, ensure_ascii=False).encode() + b"\n\n")


async def sse_live(chunks: AsyncIterator[Mapping[str, Any]]) -> AsyncIterator[bytes]:
    """:func:`sse` of chunks produced while the answer is generated; an answer that fails on the
    way ends with an ``{"error": {...}}`` chunk (see :mod:`~agentloop_engines.serving.gateway.stream_errors`)."""
    try:
        async for chunk in chunks:
            yield b"data: " + json.dumps(chunk, ensure_ascii=False).encode() + b"\n\n"
    except Exception as exc:  # noqa: BLE001 - the status is sent: the stream's own error event says it
        yield b"data: " + json.dumps(openai_error_chunk(exc), ensure_ascii=False).encode() + b"\n\n"
    yield b"data: [DONE]\n\n"


@dataclass(frozen=True)
class GatewayResponse:
    """One answered request."""

    body: dict[str, Any]
    """The OpenAI response object (``chat.completion`` or ``text_completion``)."""
    stream: bool
    """The client asked for server-sent events."""
    include_usage: bool
    """The client asked for a usage chunk at the end of the stream."""
    call: RecordedCall | None
    """What was recorded, when the request was made in a session."""

    def chunks(self) -> list[dict[str, Any]]:
        """The stream chunks of :attr:`body` (without the final ``[DONE]``)."""
        make = chat_chunks if self.body["object"] == "chat.completion" else completion_chunks
        return list(make(self.body, self.include_usage))
