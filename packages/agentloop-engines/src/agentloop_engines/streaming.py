"""Token streams: an engine's tokens as they are decoded, not only once the request ends.

``generate_stream(request_id, prompt_ids, sampling_params)`` yields :class:`TokenDelta`\\ s.
The law of a stream: the ``token_ids`` of its deltas, joined in order, are exactly the
``token_ids`` of the :class:`~agentloop_core.protocol.TokenOutput` its last delta carries
(``output``), which is what ``generate`` returns for the same request; so a caller may show the
deltas as they come and still record the exact ids for training from ``output``.

Engines that cannot stream (any ``AsyncServer`` with ``generate`` only) are streamed as one
delta by :func:`stream_tokens`; closing a stream early (a client that went away) cancels the
engine request, which stops its decoding as cancelling ``generate`` does.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from agentloop_core.protocol import SamplingParams, TokenOutput

__all__ = ["OnTokens", "TokenDelta", "queued_stream", "stream_tokens"]

OnTokens = Callable[[list[int], list[float] | None], None]
"""Called on the event loop with the ids (and log-probs) decoded since the last call."""


@dataclass(frozen=True)
class TokenDelta:
    """The tokens one engine step (or several) added to a streamed request."""

    token_ids: list[int]
    """Ids generated since the previous delta (may be empty in the last one)."""
    log_probs: list[float] | None = None
    """One log-prob per id in :attr:`token_ids` when log-probs were asked for, else None."""
    output: TokenOutput | None = None
    """The whole result, on the last delta only: the ids of every delta joined, the log-probs,
    the stop reason and the engine's ``extra``."""

    def __post_init__(self) -> None:
        if self.log_probs is not None and len(self.log_probs) != len(self.token_ids):
            raise ValueError(f"TokenDelta has {len(self.token_ids)} token ids but {len(self.log_probs)} log-probs")


async def stream_tokens(server: Any, request_id: str, prompt_ids: list[int],
                        sampling_params: Mapping[str, Any] | SamplingParams | None,
                        **multi_modal: Any) -> AsyncGenerator[TokenDelta, None]:
    """The token stream of one request on any ``AsyncServer``: its ``generate_stream`` when its
    class defines one, else one delta holding what ``generate`` returned. ``multi_modal_data``,
    when given, goes to either (only a vision engine is given one).

    The class, not the instance: a wrapper that forwards unknown attributes to its engine
    (core's ``TransparentServerWrapper``) would otherwise hand out the engine's stream and skip
    what the wrapper's own ``generate`` adds (a seed, partial-rollout bookkeeping, counters).
    """
    stream = getattr(server, "generate_stream", None) if callable(getattr(type(server), "generate_stream", None)) \
        else None
    if stream is not None:
        deltas: Any = stream(request_id, prompt_ids, sampling_params, **multi_modal)
        try:
            async for delta in deltas:
                yield delta
        finally:
            close = getattr(deltas, "aclose", None)  # at once: closing the stream stops the request
            if close is not None:
                await close()
        return
    out = await server.generate(request_id, prompt_ids, sampling_params, **multi_modal)
    yield TokenDelta(list(out.token_ids), None if out.log_probs is None else list(out.log_probs), out)


_END = object()


async def queued_stream(run: Callable[[OnTokens], Awaitable[TokenOutput]]) -> AsyncGenerator[TokenDelta, None]:
    """Stream a request that reports its tokens through a callback.

    ``run(on_tokens)`` generates the request, calling ``on_tokens`` on the event loop as tokens
    are decoded, and returns the whole :class:`TokenOutput`. Tokens that arrive while the
    consumer is busy are joined into one delta. The last delta carries the output and whatever
    of its ids were not reported (all of them when ``run`` never calls back).

    Raises:
        RuntimeError: when the reported ids are not a prefix of the output's (an engine bug that
            would break the stream's law).
    """
    queue: asyncio.Queue[Any] = asyncio.Queue()
    task = asyncio.ensure_future(run(lambda ids, lps: queue.put_nowait((ids, lps))))
    task.add_done_callback(lambda _: queue.put_nowait(_END))
    sent: list[int] = []
    try:
        while True:
            item = await queue.get()
            if item is _END:
                break
            ids, lps = list(item[0]), None if item[1] is None else list(item[1])
            ended = False
            while not queue.empty():
                nxt = queue.get_nowait()
                if nxt is _END:
                    ended = True
                    break
                ids.extend(nxt[0])
                if lps is not None:
                    lps.extend(nxt[1])
            sent.extend(ids)
            yield TokenDelta(ids, lps)
            if ended:
                break
        out = task.result()
        if list(out.token_ids[: len(sent)]) != sent:
            raise RuntimeError(f"the engine streamed {len(sent)} ids that are not the start of the {len(out.token_ids)} "
                               "ids it returned; the stream would not match what is recorded for training")
        rest = list(out.token_ids[len(sent):])
        yield TokenDelta(rest, None if out.log_probs is None else list(out.log_probs[len(sent):]), out)
    finally:
        if not task.done():
            # The consumer went away (a client disconnect): stop decoding this request.
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
