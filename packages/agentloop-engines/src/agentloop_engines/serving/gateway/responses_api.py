"""OpenAI's Responses API (``POST /v1/responses``) served as a translation of the chat path.

:func:`create_response` translates the body into a chat completions body
(:mod:`~agentloop_engines.serving.gateway.responses_request`), answers it with
:meth:`Gateway.chat_completion` or :func:`~agentloop_engines.serving.gateway.live.stream_chat_completion`
(recorded with ``endpoint="responses"``), and translates the answer back: the ``response``
object (:mod:`~agentloop_engines.serving.gateway.responses_output`) or its stream events
(:mod:`~agentloop_engines.serving.gateway.responses_stream`). So one renderer, one session recorder and
one token-exact continuation serve both APIs: a Responses conversation that sends back the
items it got (or names them with ``previous_response_id``) continues the previous call's ids
exactly, as a chat conversation does, and renders the same prompt as the same conversation sent
as chat messages.

``previous_response_id`` works within a session: the session keeps each response's conversation
(its input as chat messages and the assistant message it returned, linked to the response it
continued) until the session is closed: one per recorded call, so no more than the recorder's
``max_calls_per_session``. Outside a session nothing is kept, so a request naming one is a
400 that says to send the whole input.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from agentloop_engines.serving.gateway.live import stream_chat_completion
from agentloop_engines.serving.gateway.prompt_limits import PromptLimitError
from agentloop_engines.serving.gateway.recorder import check_session_id
from agentloop_engines.serving.gateway.responses_output import new_id, output_items, response_object
from agentloop_engines.serving.gateway.responses_request import ResponsesRequest, parse_responses_request
from agentloop_engines.serving.gateway.responses_stream import ResponseEvents

if TYPE_CHECKING:
    from agentloop_engines.serving.gateway.core import Gateway

__all__ = ["create_response"]

_STATE_KEY = "responses"
"""The key of a session's stored responses in :meth:`Gateway.session_state`."""


@dataclass(frozen=True)
class _Stored:
    """A stored response's conversation: the one it continued, then its own messages."""

    parent: _Stored | None
    """The stored response it continued (``previous_response_id``), or None."""
    messages: tuple[dict[str, Any], ...]
    """Its new input as chat messages and the assistant message it returned."""

    def conversation(self) -> list[dict[str, Any]]:
        """Every chat message of the conversation, the oldest first."""
        chain: list[_Stored] = []
        node: _Stored | None = self
        while node is not None:  # a loop, not recursion: a session may chain a thousand responses
            chain.append(node)
            node = node.parent
        return [message for stored in reversed(chain) for message in stored.messages]


async def create_response(gateway: Gateway, body: Mapping[str, Any], *, session_id: str | None = None,
                          session_key: str | None = None) -> dict[str, Any] | AsyncIterator[dict[str, Any]]:
    """Answer a ``/v1/responses`` body.

    Args:
        gateway: The gateway whose chat path answers it.
        body: The Responses API request.
        session_id: Record the call in this session (and keep the response for a later
            ``previous_response_id``), as in :meth:`Gateway.chat_completion`.
        session_key: The key the call carried (an HTTP client's); None: an in-process call.

    Returns:
        The ``response`` object; with ``stream: true`` an async iterator of its events (dicts
        with ``type`` and ``sequence_number``; over HTTP each is sent as
        ``event: <type>`` / ``data: <json>``), ending with ``response.completed`` (or
        ``response.incomplete``; an answer that fails after the first event ends with
        ``response.failed`` and an ``error`` event, see
        :mod:`~agentloop_engines.serving.gateway.stream_errors`).

    Raises:
        ValueError: on an unsupported key, value or input item (named, with what to send instead),
            a ``previous_response_id`` outside a session or not in it, and whatever
            :meth:`Gateway.chat_completion` raises for the translated body. A streamed request
            raises here, before its first event.
        PromptLimitError: an ``input`` or ``tools`` list over the gateway's limits, or the
            chat path's own limits.
        SessionNotFoundError: with ``session_key``, when it is not the key of an open session.
    """
    _check_lengths(gateway, body)
    req = parse_responses_request(body)
    previous = _previous(gateway, req, session_id, session_key)
    # "stream" as the client asked: the chat call below is chosen by it, and the recording shows it.
    chat_body = {**req.chat, "messages": req.conversation(previous.conversation() if previous else []),
                 "stream": req.stream}
    response_id, created = new_id("resp"), int(time.time())
    model = req.chat.get("model") or gateway.model_name
    if req.stream:
        chunks = await stream_chat_completion(gateway, chat_body, session_id=session_id, session_key=session_key,
                                              endpoint="responses")
        return _events(gateway, req, chunks, previous, response_id, created, model, session_id)
    answer = await gateway.chat_completion(chat_body, session_id=session_id, session_key=session_key,
                                           endpoint="responses")
    choice = answer.body["choices"][0]
    message = choice["message"]
    prompt_ids = answer.body.get("prompt_token_ids")
    thought = await _reasoning_tokens(gateway, prompt_ids, choice["token_ids"], message.get("reasoning_content"))
    response = response_object(response_id, created, model, req.echo, output_items(message, choice["finish_reason"]),
                               finish_reason=choice["finish_reason"], tokens={**choice, "prompt_token_ids": prompt_ids},
                               session_id=session_id, reasoning_tokens=thought)
    _store(gateway, session_id, response_id, req, previous, message)
    return response


async def _events(gateway: Gateway, req: ResponsesRequest, chunks: AsyncIterator[dict[str, Any]],
                  previous: _Stored | None, response_id: str, created: int, model: str,
                  session_id: str | None) -> AsyncIterator[dict[str, Any]]:
    """The Responses events of a streamed chat answer's chunks."""
    events = ResponseEvents()
    for event in events.start(response_object(response_id, created, model, req.echo, [])):
        yield event
    last: dict[str, Any] | None = None
    try:
        async for chunk in chunks:
            for choice in chunk.get("choices") or ():
                for event in events.feed(choice.get("delta") or {}):
                    yield event
                if choice.get("finish_reason") is not None:
                    last = {**choice, "prompt_token_ids": chunk.get("prompt_token_ids")}
        assert last is not None, "a chat stream ended without its finish chunk"
        for event in events.finish(last["finish_reason"]):
            yield event
        thought = await _reasoning_tokens(gateway, last["prompt_token_ids"], last["token_ids"], events.reasoning)
        response = response_object(response_id, created, model, req.echo, events.output,
                                   finish_reason=last["finish_reason"], tokens=last, session_id=session_id,
                                   reasoning_tokens=thought)
    except Exception as exc:  # noqa: BLE001 - after the first event: the stream's own failure events say it
        for event in events.failed(response_object(response_id, created, model, req.echo, events.output), exc):
            yield event
        return
    finally:
        close = getattr(chunks, "aclose", None)
        if close is not None:  # a client that went away: closing the chat stream stops the engine
            await close()
    _store(gateway, session_id, response_id, req, previous, events.message())
    yield events.done(response)


async def _reasoning_tokens(gateway: Gateway, prompt_ids: Any, token_ids: Any, reasoning: str | None) -> int:
    """How many generated ids are reasoning, for ``usage`` (decodes only when there was reasoning)."""
    if not reasoning:
        return 0
    return await gateway._off_loop(gateway._output.reasoning_tokens, prompt_ids or (), token_ids or ())


def _check_lengths(gateway: Gateway, body: Mapping[str, Any]) -> None:
    """Refuse an oversized ``input`` or ``tools`` list before walking it (the chat path's
    ``max_messages`` and ``max_tools``)."""
    if not isinstance(body, Mapping):
        return
    limits = gateway.prompt_limits
    for key, limit, name in (("input", limits.max_messages, "max_messages"), ("tools", limits.max_tools, "max_tools")):
        value = body.get(key)
        if isinstance(value, list) and len(value) > limit:
            raise PromptLimitError(f"the request's {key!r} has {len(value)} entries; the limit is {limit} ({name}: "
                                   f"raise it with PromptLimits({name}=...) on the server)")


def _previous(gateway: Gateway, req: ResponsesRequest, session_id: str | None,
              session_key: str | None) -> _Stored | None:
    """The stored response ``previous_response_id`` names, or None without one."""
    wanted = req.previous_response_id
    if wanted is None:
        return None
    if session_id is None:
        raise ValueError(f"previous_response_id={wanted[:80]!r} works within a session only (the gateway keeps a "
                         "session's responses until the session is closed, and nothing outside one); send the whole "
                         "conversation as 'input' instead")
    if session_key is not None:  # before the session's state is read: a caller without the key learns nothing
        gateway.recorder.authorize(check_session_id(session_id), session_key)
    stored = _stored(gateway, session_id)
    if stored is None or wanted not in stored:
        raise ValueError(f"previous_response_id={wanted[:80]!r} is not a response of session {session_id!r}: it "
                         "was not returned in it (or in an earlier session of that id) or was made with store=false; "
                         "send the whole conversation as 'input' instead")
    return stored[wanted]


def _stored(gateway: Gateway, session_id: str, *, create: bool = False) -> dict[str, _Stored] | None:
    """The session's stored responses by id; None for a session that is not open, or that has
    none and ``create`` is off. They live in the session's state, so they go with the session
    (closed, expired or evicted): a session id opened anew starts with nothing stored."""
    if session_id not in gateway.recorder:
        return None
    state = gateway.session_state(session_id)
    if _STATE_KEY not in state:
        if not create:
            return None
        state[_STATE_KEY] = {}
    return state[_STATE_KEY]


def _store(gateway: Gateway, session_id: str | None, response_id: str, req: ResponsesRequest,
           previous: _Stored | None, message: Mapping[str, Any]) -> None:
    """Keep a session's response for a later ``previous_response_id`` (not with ``store: false``).
    One per recorded call, so the recorder's ``max_calls_per_session`` bounds them."""
    if session_id is None or not req.store:
        return
    stored = _stored(gateway, session_id, create=True)
    if stored is not None:
        stored[response_id] = _Stored(previous, (*req.messages, dict(message)))
