"""What a stream sends when its answer fails after its first event.

A streamed answer's HTTP status (200) is sent with its first event, so an engine that fails
later (a replica that dies or times out mid-decode) cannot turn it into an error response; a
stream that just stopped would reach the client as a connection error, which a client retries
or reports as a network fault. So each API ends the stream with its own in-stream error, which
its stock client raises as an API error carrying the message:

* Chat and text completions: a last ``data: {"error": {"message", "type", "code"}}`` chunk
  (vLLM's), then ``data: [DONE]`` (:func:`openai_error_chunk`);
* Messages: an ``event: error`` with Anthropic's error object (:func:`anthropic_error_event`);
* Responses: a ``response.failed`` event (the response, ``status: "failed"`` and its ``error``)
  and an ``error`` event (:mod:`~agentloop_engines.serving.gateway.responses_api`).

Nothing is recorded for a call that failed. The status and code are those the same exception
gets as a plain error response (:data:`ERRORS`, ``ValueError`` 400, anything else 500).
"""

from __future__ import annotations

import logging

from agentloop_engines.fleet.routing import NoHealthyReplicaError, RequestTimeoutError
from agentloop_engines.serving.error_shapes import anthropic_error, openai_error
from agentloop_engines.serving.gateway.prompt_limits import PromptLimitError
from agentloop_engines.serving.gateway.recorder import (
    SessionCallLimitError,
    SessionExistsError,
    SessionNotFoundError,
)

logger = logging.getLogger(__name__)

__all__ = ["ERRORS", "anthropic_error_event", "openai_error_chunk", "stream_error"]

ERRORS: dict[type[BaseException], tuple[int, str]] = {
    SessionNotFoundError: (404, "session_not_found"),
    SessionExistsError: (409, "session_exists"),
    SessionCallLimitError: (400, "session_call_limit"),
    PromptLimitError: (413, "request_too_large"),
    NoHealthyReplicaError: (503, "engine_unavailable"),
    RequestTimeoutError: (504, "engine_timeout"),
}
"""The HTTP status and error code of the gateway's own exceptions."""


def stream_error(exc: Exception) -> tuple[int, str, str]:
    """``(status, message, code)`` of a streamed answer that failed with ``exc`` after its
    first event; logs it with its traceback (the client gets the message only)."""
    logger.error("a streamed answer failed after its first event: %s: %s", type(exc).__name__, exc, exc_info=exc)
    status, code = next(((s, c) for t, (s, c) in ERRORS.items() if isinstance(exc, t)),
                        (400, "invalid_request") if isinstance(exc, ValueError) else (500, "engine_error"))
    what = f"{type(exc).__name__}: {exc}" if status >= 500 else str(exc)
    message = (f"the answer failed while it was streamed ({what}); nothing was recorded for this call, so sending "
               "it again is safe")
    return status, message, code


def openai_error_chunk(exc: Exception) -> dict[str, object]:
    """The last chunk of a failed chat or text completion stream (``{"error": {...}}``)."""
    return openai_error(*stream_error(exc))


def anthropic_error_event(exc: Exception) -> dict[str, object]:
    """The ``error`` event that ends a failed Messages stream."""
    return anthropic_error(*stream_error(exc))
