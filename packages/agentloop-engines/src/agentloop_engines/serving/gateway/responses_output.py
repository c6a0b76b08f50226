"""The Responses API's ``response`` object and its output items, built from a chat answer.

A chat assistant message becomes, in order: a ``reasoning`` item (its ``reasoning_content``, as
``reasoning_text`` content; no summary), a ``message`` item (its text, one ``output_text`` part)
when it has text or nothing else (a reply of only the end of the turn is a message with an
empty ``output_text``, so the items sent back hold the turn and continue it), and one ``function_call`` item per tool call (``call_id`` is the chat call's
id, so a ``function_call_output`` answers it as a tool message answers the chat call). A chat
``finish_reason`` of ``length`` makes the response ``incomplete`` (reason ``max_output_tokens``)
and its message item (else its reasoning item) ``incomplete``; ``abort`` (the session's calls
were aborted) makes it ``cancelled``.

The exact tokens ride along as extension fields of the response object, as they do in a chat
completion: ``prompt_token_ids``, ``token_ids``, ``token_logprobs``, ``session_id`` in a
session, and ``tool_call_errors`` when a drafted call could not be parsed.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["TOKEN_FIELDS", "function_call_item", "message_item", "new_id", "output_items", "reasoning_item",
           "response_object", "response_status"]

TOKEN_FIELDS = ("prompt_token_ids", "token_ids", "token_logprobs", "tool_call_errors")
"""The extension fields a finished response carries (``tool_call_errors`` only when some)."""


def new_id(prefix: str) -> str:
    """A fresh id in OpenAI's style (``resp_...``, ``msg_...``, ``rs_...``, ``fc_...``)."""
    return f"{prefix}_{uuid.uuid4().hex}"


def reasoning_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    """A ``reasoning`` output item holding ``text`` as one ``reasoning_text`` part."""
    content = [{"type": "reasoning_text", "text": text}] if text else []
    return {"id": item_id, "type": "reasoning", "summary": [], "content": content, "status": status}


def message_item(item_id: str, text: str | None, status: str = "completed") -> dict[str, Any]:
    """An assistant ``message`` output item; ``text`` None: no content part yet (a stream's start)."""
    content = [] if text is None else [{"type": "output_text", "text": text, "annotations": []}]
    return {"id": item_id, "type": "message", "status": status, "role": "assistant", "content": content}


def function_call_item(item_id: str, call: Mapping[str, Any], status: str = "completed",
                       arguments: str | None = None) -> dict[str, Any]:
    """A ``function_call`` output item of a chat tool call (``arguments``: instead of the call's)."""
    function = call["function"]
    return {"id": item_id, "type": "function_call", "status": status, "call_id": call["id"],
            "name": function["name"], "arguments": function["arguments"] if arguments is None else arguments}


def output_items(message: Mapping[str, Any], finish_reason: str) -> list[dict[str, Any]]:
    """The output items of a chat assistant ``message`` that finished with ``finish_reason``."""
    reasoning = message.get("reasoning_content") or ""
    text = message.get("content") or ""
    calls = message.get("tool_calls") or ()
    cut = "incomplete" if finish_reason == "length" else "completed"
    items = []
    if reasoning:
        items.append(reasoning_item(new_id("rs"), reasoning, cut if not text and not calls else "completed"))
    if text or not (reasoning or calls):  # a reply of nothing is an empty message, so resending it continues
        items.append(message_item(new_id("msg"), text, cut))
    items.extend(function_call_item(new_id("fc"), call) for call in calls)
    return items


def response_status(finish_reason: str) -> tuple[str, dict[str, Any] | None]:
    """The response ``status`` and ``incomplete_details`` of a chat ``finish_reason``."""
    if finish_reason == "length":
        return "incomplete", {"reason": "max_output_tokens"}
    if finish_reason == "abort":
        return "cancelled", None
    return "completed", None


def response_object(response_id: str, created_at: int, model: str, echo: Mapping[str, Any],
                    output: Sequence[Mapping[str, Any]], *, finish_reason: str | None = None,
                    tokens: Mapping[str, Any] | None = None, session_id: str | None = None,
                    reasoning_tokens: int = 0) -> dict[str, Any]:
    """The ``response`` object.

    Args:
        response_id: Its ``resp_...`` id.
        created_at: When the request arrived (Unix seconds).
        model: The model named by the request, else the gateway's.
        echo: The request fields the object repeats (:attr:`ResponsesRequest.echo`).
        output: Its output items.
        finish_reason: The chat answer's finish reason; None: the response is still in progress
            (a stream's first events), without usage or token fields.
        tokens: The chat answer's token fields (:data:`TOKEN_FIELDS`), when finished.
        session_id: The session it was recorded in, or None.
        reasoning_tokens: How many of the generated ids are reasoning (``usage``'s
            ``output_tokens_details.reasoning_tokens``).
    """
    status, incomplete = ("in_progress", None) if finish_reason is None else response_status(finish_reason)
    body: dict[str, Any] = {
        "id": response_id, "object": "response", "created_at": created_at, "status": status, "background": False,
        "error": None, "incomplete_details": incomplete, **echo, "model": model, "output": list(output),
        "usage": None}
    if finish_reason is not None:
        body["completed_at"] = int(time.time())
    if tokens is not None:
        n_in, n_out = len(tokens.get("prompt_token_ids") or ()), len(tokens.get("token_ids") or ())
        body["usage"] = {"input_tokens": n_in, "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
                         "output_tokens": n_out, "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
                         "total_tokens": n_in + n_out}
        body.update({k: tokens.get(k) for k in TOKEN_FIELDS[:3]})
        if tokens.get("tool_call_errors"):
            body["tool_call_errors"] = tokens["tool_call_errors"]
    if session_id is not None:
        body["session_id"] = session_id
    return body
