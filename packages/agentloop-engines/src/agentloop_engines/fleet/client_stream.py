"""``LLMServerClient.generate_stream``: a routed request whose tokens are handed on as decoded.

The stream is routed as ``generate`` is (least in-flight, the sticky session of its request id,
stale and restarted replicas avoided): opening it on a replica, up to and including its first
delta, is one attempt of the client's routing loop, so everything that can go wrong before
the first token (a replica down or refusing at its in-flight limit, no first delta within
``request_timeout_s``, an engine that restarted and lost the pushed weights, which a
:class:`~agentloop_engines.fleet.http_client.EngineHTTPClient` knows from the answer's headers) is
retried on another replica exactly as for ``generate``.

After the first delta has been yielded nothing is retried: those tokens are the caller's
already (an agent may have shown them, a gateway sent them), and another replica would sample
a different continuation. A later failure of the replica raises to the caller as it came (it
still takes a dead replica out of rotation); a gap between two deltas longer than
``request_timeout_s`` aborts the request on its replica and raises
:class:`~agentloop_engines.fleet.routing.RequestTimeoutError`. The replica's in-flight slot is held
until the stream ends, fails or is closed; closing it early (a client that went away) aborts
the request on the replica, as cancelling ``generate`` does.

The stream keeps the law of :mod:`agentloop_engines.streaming`: the deltas' ids, joined, are
checked to be the last delta's ``output`` ids, whose ``extra["replica"]`` names the replica.
A Ray actor replica streams as one delta (its ``generate``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Any, Protocol

from agentloop_core.protocol import SamplingParams
from agentloop_engines.fleet.replica_calls import Replica, ReplicaCall, is_own_timeout, is_replica_failure
from agentloop_engines.fleet.routing import RequestTimeoutError, StickyLeastInFlightPolicy
from agentloop_engines.streaming import TokenDelta, stream_tokens

__all__ = ["routed_stream"]


class _StreamCounts(Protocol):
    completed: int
    failed: int
    timeouts: int


class RoutingClient(Protocol):
    """What a routed stream needs of :class:`~agentloop_engines.fleet.client.LLMServerClient` (typed
    here so that this module does not import the client that imports it)."""

    policy: StickyLeastInFlightPolicy
    request_timeout_s: float | None
    retry_on: tuple[type[BaseException], ...]

    @property
    def client_stats(self) -> _StreamCounts: ...

    async def _routed(self, request_id: str, call: ReplicaCall, *, prompt_tokens: int | None = None) -> Any: ...

    def _on_replica_failure(self, replica: Replica, request_id: str, exc: BaseException) -> Any: ...


@dataclass
class _Opened:
    """A stream open on a replica, its first delta received (and not yet yielded)."""

    replica: Replica
    first: TokenDelta
    deltas: AsyncGenerator[TokenDelta, None]


class _OpenStream(ReplicaCall):
    """The attempt of a stream: open it on the replica and wait for its first delta."""

    holds = True

    def __init__(self, request_id: str, prompt_ids: list[int], sp: SamplingParams,
                 kwargs: dict[str, Any] | None = None) -> None:
        super().__init__("generate", (request_id, prompt_ids, sp), kwargs)

    async def run(self, replica: Replica) -> _Opened:
        if replica.is_actor:
            out = await replica.call("generate", *self.args, **self.kwargs)
            deltas = _one_delta(TokenDelta(list(out.token_ids), None if out.log_probs is None else list(out.log_probs),
                                           out))
        else:
            deltas = stream_tokens(replica.target, *self.args, **self.kwargs)
        try:
            first = await anext(deltas)
        except BaseException:
            await deltas.aclose()  # a timeout or a refusal: stop whatever started there
            raise
        return _Opened(replica, first, deltas)

    def instance(self, replica: Replica, result: _Opened) -> Any:
        if result.first.output is not None:
            return result.first.output.extra.get("engine_instance")
        # Read from the answer's headers before its first delta (EngineHTTPClient); None elsewhere.
        return getattr(replica.target, "engine_instance", None)

    async def discard(self, result: _Opened) -> None:
        await result.deltas.aclose()


async def _one_delta(delta: TokenDelta) -> AsyncGenerator[TokenDelta, None]:
    yield delta


async def routed_stream(client: RoutingClient, request_id: str, prompt_ids: list[int],
                        sp: SamplingParams, kwargs: dict[str, Any] | None = None) -> AsyncGenerator[TokenDelta, None]:
    """The token stream of one request routed by ``client`` (see the module docstring);
    ``kwargs`` (``multi_modal_data``) go with every attempt."""
    opened: _Opened = await client._routed(request_id, _OpenStream(request_id, prompt_ids, sp, kwargs),
                                           prompt_tokens=len(prompt_ids))
    replica, index = opened.replica, opened.replica.index
    sent: list[int] = []
    try:
        async with contextlib.aclosing(opened.deltas) as deltas:
            delta = opened.first
            while True:
                sent.extend(delta.token_ids)
                if delta.output is not None:
                    if list(delta.output.token_ids) != sent:
                        raise RuntimeError(
                            f"replica {index} streamed {len(sent)} ids that are not the {len(delta.output.token_ids)} "
                            f"ids of its output for request {request_id!r}; the stream would not match what is "
                            "recorded for training")
                    output = dataclasses.replace(delta.output, extra={**delta.output.extra, "replica": index})
                    client.client_stats.completed += 1
                    yield dataclasses.replace(delta, output=output)
                    return
                yield delta
                delta = await _next(deltas, client.request_timeout_s, request_id, index, len(sent))
    except RequestTimeoutError:
        client.client_stats.timeouts += 1
        client.client_stats.failed += 1
        raise  # the stream was closed by the timeout, which stopped the request on the replica
    except Exception as exc:
        client.client_stats.failed += 1
        if (is_replica_failure(exc) or isinstance(exc, client.retry_on)) and not is_own_timeout(exc):
            client._on_replica_failure(replica, request_id, exc)  # out of rotation; this stream is not retried
        raise
    finally:
        client.policy.release(index)


async def _next(deltas: AsyncGenerator[TokenDelta, None], timeout_s: float | None, request_id: str, index: int,
                sent: int) -> TokenDelta:
    try:
        if timeout_s is None:
            return await anext(deltas)
        return await asyncio.wait_for(anext(deltas), timeout_s)
    except StopAsyncIteration:
        raise RuntimeError(f"replica {index}'s stream of request {request_id!r} ended without its output") from None
    except TimeoutError as exc:
        if not is_own_timeout(exc):
            raise
        raise RequestTimeoutError(
            f"request {request_id!r}: replica {index} sent no tokens within the time limit (request_timeout_s="
            f"{timeout_s}, or the EngineHTTPClient's timeout_s) after streaming {sent}; it was aborted there and not retried (the tokens already streamed cannot be taken "
            "back)") from exc
