"""The JSON bodies of HTTP errors, in the shape the client of each API parses.

The engine server and the gateway answer errors in OpenAI's shape,
``{"error": {"message", "type", "code"}}``; the gateway's Anthropic routes (``/v1/messages``)
answer in Anthropic's, ``{"type": "error", "error": {"type", "message"}}``, whose ``type`` the
``anthropic`` SDK reads with the status. An app picks the shape per request path
(:data:`ErrorShapes`), so its request guard (auth, limits: before any route runs) and its
exception handlers answer one route the same way.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["ANTHROPIC_ERROR_TYPES", "ErrorBody", "ErrorShapes", "anthropic_error", "openai_error", "openai_everywhere"]

ErrorBody = Callable[[int, str, str], dict[str, Any]]
"""``(status, message, code) -> JSON body`` of one error."""

ErrorShapes = Callable[[str], ErrorBody]
"""The :data:`ErrorBody` of a request path."""


def openai_error(status: int, message: str, code: str) -> dict[str, Any]:
    """OpenAI's error body: ``type`` is ``invalid_request_error`` below 500, else ``server_error``."""
    return {"error": {"message": message, "type": "invalid_request_error" if status < 500 else "server_error",
                      "code": code}}


ANTHROPIC_ERROR_TYPES: dict[int, str] = {
    400: "invalid_request_error", 401: "authentication_error", 403: "permission_error", 404: "not_found_error",
    408: "timeout_error", 409: "invalid_request_error", 413: "request_too_large", 429: "rate_limit_error",
    500: "api_error", 501: "invalid_request_error", 503: "overloaded_error", 504: "timeout_error",
    529: "overloaded_error"}
"""Anthropic's error ``type`` per HTTP status (a status not listed: ``invalid_request_error``
below 500, else ``api_error``)."""


def anthropic_error(status: int, message: str, code: str) -> dict[str, Any]:
    """Anthropic's error body; our ``code`` (which limit, which check) rides along as
    ``error.code``, which the SDK ignores and a person reading the body can use."""
    kind = ANTHROPIC_ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": message, "code": code}}


def openai_everywhere(path: str) -> ErrorBody:
    """The :data:`ErrorShapes` of an app that speaks OpenAI's API alone."""
    return openai_error
