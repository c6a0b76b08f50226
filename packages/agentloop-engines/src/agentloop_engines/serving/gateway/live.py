"""Streamed answers (``stream: true``) sent as the engine decodes them.

:func:`stream_chat_completion` and :func:`stream_completion` prepare the request as the whole
answer would be (render, session plan, sampling parameters), start the engine's token stream
(:func:`agentloop_engines.streaming.stream_tokens`: the engine's ``generate_stream``, or one
delta from ``generate``) and wait for its first delta, so a bad request or an engine that
refuses still gets a plain JSON error before any event. They return the chunk iterator: a role
chunk, then each delta :class:`~agentloop_engines.serving.gateway.stream_text.StreamText` lets through,
then, once the engine is done, the rest of the finished answer (built, recorded in the session
and continued exactly as a non-streamed one: the exact ids are the engine's final output, never
the text sent), the finish chunk with the token-id extension fields, and the usage chunk when
``stream_options.include_usage``.

A prompt with images streams the same way, its images passed as ``multi_modal_data``.

A client that disconnects cancels the iteration (:func:`~agentloop_engines.serving.watch.serve_until_gone`),
which closes the engine stream and so stops its decoding; nothing is recorded for that call.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from agentloop_core.reasoning import PROMPT_TAIL_TOKENS
from agentloop_core.vision import ImageItem, multi_modal_kwargs
from agentloop_engines.serving.gateway.openai_response import final_chunks, stream_head
from agentloop_engines.serving.gateway.stream_text import StreamText
from agentloop_engines.streaming import TokenDelta, stream_tokens

if TYPE_CHECKING:
    from agentloop_engines.serving.gateway.core import Gateway

__all__ = ["stream_chat_completion", "stream_completion"]

_END = object()


async def stream_chat_completion(gateway: Gateway, body: Mapping[str, Any], *, session_id: str | None = None,
                                 session_key: str | None = None, endpoint: str = "chat.completions",
                                 report_prompt_tokens: bool = False) -> AsyncIterator[dict[str, Any]]:
    """The ``chat.completion.chunk`` objects of a streamed ``/v1/chat/completions`` body, sent
    as generated; arguments and errors as in :meth:`Gateway.chat_completion` (raised here,
    before the first chunk). ``report_prompt_tokens``: the role chunk also carries
    ``prompt_tokens``, the prompt's length (the Messages API's ``message_start`` reports it)."""
    req, prompt_ids, plan, images = await gateway._prepare_chat(body, session_id, session_key)
    request_id, params = await gateway._engine_request("chatcmpl", prompt_ids, req, session_id, session_key)
    tools_parsed = req.parse_tool_calls and gateway.parser is not None
    in_reasoning = False
    if gateway.reasoning is not None and gateway.reasoning.reads_prompt:
        tail = await gateway._off_loop(gateway.tokenizer.decode, list(prompt_ids[-PROMPT_TAIL_TOKENS:]),
                                       skip_special_tokens=False)
        in_reasoning = gateway.reasoning.starts_in_reasoning(tail)
    text = StreamText(gateway._text, req.stop, reasoning=gateway.reasoning, in_reasoning=in_reasoning,
                      parser=gateway.parser if tools_parsed else None,
                      tools={t["function"]["name"]: t for t in req.tools or ()},
                      format_calls=lambda parsed: gateway._output.format_calls(parsed, req.messages))
    deltas = _server_stream(gateway, request_id, prompt_ids, params, images)
    first = await _first(deltas)
    head = stream_head("chatcmpl", "chat.completion.chunk", req.model or gateway.model_name)

    async def chunks() -> AsyncIterator[dict[str, Any]]:
        async with contextlib.aclosing(deltas):
            role = {**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                         "finish_reason": None}]}
            yield {**role, "prompt_tokens": len(prompt_ids)} if report_prompt_tokens else role
            output = None
            async for delta in _chain(first, deltas):
                for piece in await gateway._off_loop(text.feed, delta.token_ids):
                    yield {**head, "choices": [{"index": 0, "delta": piece, "logprobs": None, "finish_reason": None}]}
                output = delta.output
        assert output is not None, "an engine stream ended without its output"
        gen = await gateway._generation(output, prompt_ids, req, images)
        response = await gateway._chat_response(body, req, gen, plan, session_id, endpoint)
        response.body["id"] = head["id"]  # one id for the stream and the recorded response
        choice = response.body["choices"][0]
        for piece in text.finish(choice["message"]):
            yield {**head, "choices": [{"index": 0, "delta": piece, "logprobs": None, "finish_reason": None}]}
        for chunk in final_chunks(response.body, "chat.completion.chunk", {"delta": {}, "logprobs": choice["logprobs"]},
                                  req.include_usage):
            yield chunk

    return chunks()


async def stream_completion(gateway: Gateway, body: Mapping[str, Any], *, session_id: str | None = None,
                            session_key: str | None = None) -> AsyncIterator[dict[str, Any]]:
    """The ``text_completion`` chunks of a streamed ``/v1/completions`` body, as
    :func:`stream_chat_completion` does for chat."""
    req, prompt_ids = await gateway._prepare_completion(body, session_id, session_key)
    request_id, params = await gateway._engine_request("cmpl", prompt_ids, req, session_id, session_key)
    text = StreamText(gateway._text, req.stop)
    deltas = _server_stream(gateway, request_id, prompt_ids, params)
    first = await _first(deltas)
    head = stream_head("cmpl", "text_completion", req.model or gateway.model_name)

    async def chunks() -> AsyncIterator[dict[str, Any]]:
        async with contextlib.aclosing(deltas):
            output = None
            async for delta in _chain(first, deltas):
                for piece in await gateway._off_loop(text.feed, delta.token_ids):
                    yield {**head, "choices": [{"index": 0, "text": piece["content"], "logprobs": None,
                                                "finish_reason": None}]}
                output = delta.output
        assert output is not None, "an engine stream ended without its output"
        gen = await gateway._generation(output, prompt_ids, req)
        response = await gateway._completion_response(body, req, gen, session_id)
        response.body["id"] = head["id"]
        choice = response.body["choices"][0]
        for piece in text.finish({"content": choice["text"]}):
            yield {**head, "choices": [{"index": 0, "text": piece["content"], "logprobs": None,
                                        "finish_reason": None}]}
        for chunk in final_chunks(response.body, "text_completion", {"text": "", "logprobs": choice["logprobs"]},
                                  req.include_usage):
            yield chunk

    return chunks()


async def _first(deltas: AsyncGenerator[TokenDelta, None]) -> TokenDelta:
    try:
        return await anext(deltas)
    except BaseException:
        await deltas.aclose()  # type: ignore[attr-defined]
        raise


async def _chain(first: TokenDelta, rest: AsyncGenerator[TokenDelta, None]) -> AsyncGenerator[TokenDelta, None]:
    yield first
    if first.output is None:
        async for delta in rest:
            yield delta


def _open_stream(gateway: Gateway, request_id: str, prompt_ids: list[int], params: dict[str, Any],
                 images: Sequence[ImageItem]) -> AsyncGenerator[TokenDelta, None]:
    return stream_tokens(gateway.server, request_id, prompt_ids, params, **multi_modal_kwargs(images))


async def _server_stream(gateway: Gateway, request_id: str, prompt_ids: list[int], params: dict[str, Any],
                         images: Sequence[ImageItem] = ()) -> AsyncGenerator[TokenDelta, None]:
    """The engine's token stream, run on the server's own loop when it has one (``server_loop``)."""
    loop = gateway.server_loop
    if loop is None or loop is asyncio.get_running_loop():
        async with contextlib.aclosing(_open_stream(gateway, request_id, prompt_ids, params, images)) as deltas:
            async for delta in deltas:
                yield delta
        return
    here = asyncio.get_running_loop()
    queue: asyncio.Queue[Any] = asyncio.Queue()

    async def pump() -> None:
        try:
            async with contextlib.aclosing(_open_stream(gateway, request_id, prompt_ids, params, images)) as deltas:
                async for delta in deltas:
                    here.call_soon_threadsafe(queue.put_nowait, delta)
        except Exception as exc:  # noqa: BLE001 - raised on the gateway's loop, below
            here.call_soon_threadsafe(queue.put_nowait, exc)
        else:
            here.call_soon_threadsafe(queue.put_nowait, _END)

    future = asyncio.run_coroutine_threadsafe(pump(), loop)
    try:
        while (item := await queue.get()) is not _END:
            if isinstance(item, Exception):
                raise item
            yield item
    finally:
        future.cancel()  # a client that went away: the server loop stops the request
