"""The Anthropic Messages API (``/v1/messages``, ``/v1/messages/count_tokens``) over the chat path.

A Messages body is translated into a chat completions body
(:mod:`~agentloop_engines.serving.gateway.messages_request`) and answered by
:meth:`Gateway.chat_completion` (or, streamed, by
:func:`~agentloop_engines.serving.gateway.live.stream_chat_completion`), then translated back
(:mod:`~agentloop_engines.serving.gateway.messages_response`). So one renderer, one session recorder
and the token-exact continuation serve every API: a conversation sent as Messages renders to
the same prompt ids as the same conversation sent as chat completions, and a session's next
Messages call continues the previous call's ids exactly. Calls are recorded with
``endpoint="messages"``; the recorded request and response are the chat ones.

No HTTP here: :mod:`~agentloop_engines.serving.gateway.app` serves these functions (and shapes errors
with :func:`anthropic_error_type`).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from typing import TYPE_CHECKING, Any

from agentloop_engines.serving.gateway.continuation import ChatState
from agentloop_engines.serving.gateway.live import stream_chat_completion
from agentloop_engines.serving.gateway.messages_request import (
    MessagesRequest,
    match_streamed_replies,
    to_chat_body,
)
from agentloop_engines.serving.gateway.messages_response import MessageEvents, message_body
from agentloop_engines.serving.gateway.stream_errors import anthropic_error_event

if TYPE_CHECKING:
    from agentloop_engines.serving.gateway.core import Gateway

__all__ = ["anthropic_error_type", "count_tokens", "create_message"]

_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 402: "billing_error",
                403: "permission_error", 404: "not_found_error", 409: "conflict_error", 413: "request_too_large",
                429: "rate_limit_error", 500: "api_error", 503: "overloaded_error", 504: "timeout_error",
                529: "overloaded_error"}


def anthropic_error_type(status: int) -> str:
    """The Messages API's ``error.type`` for an HTTP status (Anthropic's table: another 4xx is
    ``invalid_request_error``, another 5xx ``api_error``; the gateway's 503, no engine or too
    many requests in flight, is ``overloaded_error``)."""
    if status in _ERROR_TYPES:
        return _ERROR_TYPES[status]
    return "api_error" if status >= 500 else "invalid_request_error"


async def create_message(gateway: Gateway, body: Mapping[str, Any], *, session_id: str | None = None,
                         session_key: str | None = None) -> dict[str, Any] | AsyncIterator[dict[str, Any]]:
    """Answer a ``/v1/messages`` body.

    Args:
        gateway: The gateway whose chat path answers it.
        body: The Messages request.
        session_id: Record the call in this session (see :meth:`Gateway.chat_completion`).
        session_key: The key the call carried; None: an in-process call.

    Returns:
        The ``message`` object, with the exact tokens as extension fields
        (``prompt_token_ids``, ``token_ids``, ``token_logprobs``, and ``session_id`` in a
        session); with ``stream: true``, an async iterator of the stream's events (dicts with a
        ``type``: ``message_start``, ``content_block_start``/``_delta``/``_stop``,
        ``message_delta`` carrying the extension fields, ``message_stop``; an ``error`` event
        instead when the answer fails after the first event).

    Raises:
        ValueError: on a missing, malformed or unsupported key or block (see the module), or
            what :meth:`Gateway.chat_completion` raises; a streamed request raises them before
            its first event.
    """
    req = await _checked(gateway, body, session_id, session_key, count=False)
    # "stream" as the client asked: the chat call below is chosen by it, and the recording shows it.
    chat = {**req.chat, "stream": req.stream}
    if req.stream:
        chunks = await stream_chat_completion(gateway, chat, session_id=session_id, session_key=session_key,
                                              endpoint="messages", report_prompt_tokens=True)
        return _events(req, chunks, session_id)
    response = await gateway.chat_completion(chat, session_id=session_id, session_key=session_key,
                                             endpoint="messages")
    choice = response.body["choices"][0]
    return message_body(response.body, thinking=req.thinking, omit_thinking=req.omit_thinking,
                        stop_sequence=_matched_stop(choice))


async def count_tokens(gateway: Gateway, body: Mapping[str, Any], *, session_id: str | None = None,
                       session_key: str | None = None) -> dict[str, Any]:
    """Answer a ``/v1/messages/count_tokens`` body: ``{"input_tokens": n}``, the length of the
    prompt a ``/v1/messages`` call with these messages would get (in a session, continued from
    the session's last call as that call would be); nothing is generated or recorded.

    Raises:
        ValueError: as :func:`create_message`, and what rendering raises.
    """
    req = await _checked(gateway, body, session_id, session_key, count=True)
    _, prompt_ids, _, _ = await gateway._prepare_chat(req.chat, session_id, session_key)
    return {"input_tokens": len(prompt_ids)}


async def _checked(gateway: Gateway, body: Any, session_id: str | None, session_key: str | None, *,
                   count: bool) -> MessagesRequest:
    # Authorized before anything is parsed, as the chat path does: a caller without the key gets nothing done.
    gateway._authorize(session_id, session_key)
    if isinstance(body, Mapping):  # list lengths first, on the loop: an oversized list costs nothing
        gateway.prompt_limits.check_lists({"messages": body.get("messages"), "tools": body.get("tools"),
                                           "stop": body.get("stop_sequences")})
    req = await gateway._off_loop(to_chat_body, body, gateway.prompt_limits, count=count)
    state = gateway.recorder.chat_state(session_id) if session_id is not None and req.joined else None
    if isinstance(state, ChatState):
        await gateway._off_loop(match_streamed_replies, req, state.expected)
    return req


def _matched_stop(choice: Mapping[str, Any]) -> str | None:
    """The stop sequence that ended the generation (the chat choice's ``stop_reason``), or None."""
    return choice.get("stop_reason") if choice["finish_reason"] == "stop" else None


async def _events(req: MessagesRequest, chunks: AsyncIterator[dict[str, Any]],
                  session_id: str | None) -> AsyncIterator[dict[str, Any]]:
    events = MessageEvents(thinking=req.thinking, omit_thinking=req.omit_thinking, session_id=session_id)
    try:
        async for chunk in chunks:
            if not events.started:
                yield events.start(chunk)
            choice = chunk["choices"][0] if chunk.get("choices") else None
            if choice is None:
                continue
            for event in events.feed(choice.get("delta") or {}):
                yield event
            if choice.get("finish_reason") is not None:
                for event in events.finish(chunk, _matched_stop(choice)):
                    yield event
    except Exception as exc:  # noqa: BLE001 - after the first event: the stream's own error event says it
        yield anthropic_error_event(exc)
    finally:
        close = getattr(chunks, "aclose", None)
        if close is not None:  # a client that went away: closing the chat stream stops the decode
            await close()
