"""The wire format of a streamed ``POST /generate`` (``"stream": true``): one JSON object a line.

The engine server (:mod:`agentloop_engines.serving.server`) answers a streamed request with
``application/x-ndjson``, one record per :class:`~agentloop_engines.streaming.TokenDelta`:

* ``{"token_ids": [...], "log_probs": [...] | null}`` for each delta as it is decoded;
* the last record adds ``"done": true`` and ``"output"``: what a plain ``/generate`` answers
  (``token_ids`` of the whole answer, ``log_probs``, ``stop_reason``, ``instance``), so the
  client checks that the ids it was streamed, joined, are exactly the recorded ones;
* ``{"error": {"message", "type", "code"}}`` instead when the engine fails after the first
  record was sent (before it, the request gets a plain JSON error with its status, as
  ``/generate`` does: the server waits for the first delta before it answers 200).

:func:`ndjson_deltas` is the server side, :func:`read_ndjson_deltas` the client's
(:class:`~agentloop_engines.fleet.http_client.EngineHTTPClient`).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Mapping
from typing import Any

from agentloop_core.protocol import CapabilityNotSupportedError, TokenOutput
from agentloop_engines.streaming import TokenDelta, stream_tokens

__all__ = ["INSTANCE_HEADER", "NDJSON", "ndjson_deltas", "read_ndjson_deltas"]

INSTANCE_HEADER = "X-Agentloop-Instance"
"""The response header naming the server's lifetime (``instance``), so a client sees an engine
restart before the first delta, while it may still send the request elsewhere."""

NDJSON = "application/x-ndjson"
"""The media type of a streamed ``/generate`` answer."""


async def ndjson_deltas(server: Any, request_id: str, prompt_ids: list[int], sampling_params: dict[str, Any],
                        instance: str, *, multi_modal: Mapping[str, Any] | None = None) -> AsyncIterator[bytes]:
    """Start ``server``'s token stream and wait for its first delta; return the lines to send.
    ``multi_modal`` (``{"multi_modal_data": ...}`` for a prompt with images) goes to the engine.

    Errors before the first delta (bad input, the engine refusing) are raised here, so the
    route answers them with their own status; a later engine error ends the stream with an
    error record (``code`` ``invalid_request``, ``not_supported`` or ``server_error``). Closing the returned iterator (a client that went away
    cancels the route) closes the engine stream, which stops its decoding.
    """
    deltas = stream_tokens(server, request_id, prompt_ids, sampling_params, **(multi_modal or {}))
    try:
        first = await anext(deltas)
    except BaseException:
        await deltas.aclose()
        raise

    async def lines() -> AsyncIterator[bytes]:
        async with contextlib.aclosing(deltas):
            delta = first
            while True:
                yield _line(_record(delta, instance))
                if delta.output is not None:
                    return
                try:
                    delta = await anext(deltas)
                except StopAsyncIteration:
                    yield _line({"error": {"message": "the engine stream ended without its output", "type":
                                           "server_error", "code": "stream_incomplete"}})
                    return
                except Exception as exc:  # noqa: BLE001 - the status line is sent: say it in the stream
                    yield _line(_error_record(exc))
                    return

    return lines()


def _record(delta: TokenDelta, instance: str) -> dict[str, Any]:
    record: dict[str, Any] = {"token_ids": list(delta.token_ids),
                              "log_probs": None if delta.log_probs is None else list(delta.log_probs)}
    out = delta.output
    if out is not None:
        record["done"] = True
        record["output"] = {"token_ids": list(out.token_ids),
                            "log_probs": None if out.log_probs is None else list(out.log_probs),
                            "stop_reason": out.stop_reason, "instance": instance}
    return record


def _error_record(exc: Exception) -> dict[str, Any]:
    if isinstance(exc, ValueError):
        return {"error": {"message": str(exc), "type": "invalid_request_error", "code": "invalid_request"}}
    if isinstance(exc, CapabilityNotSupportedError):
        return {"error": {"message": str(exc), "type": "invalid_request_error", "code": "not_supported"}}
    return {"error": {"message": f"{type(exc).__name__}: {exc}", "type": "server_error", "code": "server_error"}}


def _line(record: dict[str, Any]) -> bytes:
    return json.dumps(record, separators=(",", ":")).encode() + b"\n"


async def read_ndjson_deltas(lines: AsyncIterator[str], what: str, *, on_instance: Callable[[Any], dict[str, Any]],
                             on_error: Callable[[dict[str, Any]], Exception],
                             incomplete: Callable[[str], Exception]) -> AsyncGenerator[TokenDelta, None]:
    """The :class:`TokenDelta`\\ s of a streamed answer's lines (the client side).

    Args:
        lines: The response body's lines.
        what: Names the request in errors (``POST <url>/generate``).
        on_instance: Called with the final output record; returns the output's ``extra``.
        on_error: Turns an error record into the exception to raise.
        incomplete: Makes the exception for a stream that ended before its last record.

    Raises:
        RuntimeError: when the streamed ids, joined, are not the output's ids (the stream's law).
    """
    sent: list[int] = []
    async for line in lines:
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError as exc:
            raise incomplete(f"{what}: a streamed line is not JSON ({exc}): {line[:200]!r}") from exc
        if not isinstance(record, dict) or not isinstance(record.get("token_ids", record.get("error")), (list, dict)):
            raise incomplete(f"{what}: a streamed line is not a delta record: {line[:200]!r}; is it an agentloop "
                             "engine server of a matching version?")
        if "error" in record:
            raise on_error(record)
        ids = list(record["token_ids"])
        sent.extend(ids)
        output = record.get("output") if record.get("done") else None
        if output is None:
            yield TokenDelta(ids, record.get("log_probs"))
            continue
        if list(output["token_ids"]) != sent:
            raise RuntimeError(f"{what}: the {len(sent)} streamed ids are not the {len(output['token_ids'])} ids of "
                               "the output; the stream would not match what is recorded for training")
        yield TokenDelta(ids, record.get("log_probs"),
                         TokenOutput(token_ids=list(output["token_ids"]), log_probs=output["log_probs"],
                                     stop_reason=output["stop_reason"], extra=on_instance(output)))
        return
    raise incomplete(f"{what}: the stream ended after {len(sent)} ids without its last record (the connection "
                     "dropped or the server stopped)")
