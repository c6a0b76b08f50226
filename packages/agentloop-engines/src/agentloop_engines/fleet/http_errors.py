"""What :class:`~agentloop_engines.fleet.http_client.EngineHTTPClient` raises when the engine server at the
other end fails, refuses or cannot be reached (re-exported by :mod:`agentloop_engines.fleet.http_client`).
"""

from __future__ import annotations

import json

__all__ = ["EngineHTTPError", "ReplicaBusyError", "ReplicaUnavailableError", "ResponseTooLargeError", "error_code",
           "retry_after_s"]


class ReplicaUnavailableError(ConnectionError):
    """The engine server cannot be reached or says it is unavailable (refused or dropped
    connection, 502/503/504). A ``ConnectionError``: ``LLMServerClient`` fails over on it."""


class ReplicaBusyError(ReplicaUnavailableError):
    """The engine server is at its in-flight limit (503 with ``Retry-After``): it is alive and
    will serve again shortly. ``LLMServerClient`` sends the request elsewhere or waits
    ``retry_after_s``, and keeps the replica in rotation."""

    def __init__(self, message: str, retry_after_s: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s
        """How long the server asked the client to wait (its ``Retry-After``)."""


class EngineHTTPError(RuntimeError):
    """The engine server failed the request (500 with the engine's error, or a status the
    agentloop server does not use). Not a replica failure: the request is not retried."""


class ResponseTooLargeError(EngineHTTPError):
    """The server's answer was over the client's ``max_response_bytes`` (or compressed, so of
    unknown size); see :mod:`agentloop_engines.fleet.http_body`."""


def retry_after_s(value: str | None) -> float | None:
    """The seconds of a ``Retry-After`` header, or None when it is not an in-flight limit's."""
    # Only the delta-seconds form: the agentloop servers send it; an HTTP-date (a proxy's) or
    # garbage is not an in-flight limit this client knows, so it stays a plain 503. Capped so
    # that a hostile or careless header cannot park a request for hours.
    try:
        seconds = float(value) if value is not None else None
    except ValueError:
        return None
    if seconds is None or not 0 <= seconds < float("inf"):
        return None
    return min(seconds, 30.0)


def error_code(body: bytes) -> str | None:
    """The ``error.code`` of an agentloop error body, or None for another shape."""
    try:
        return json.loads(body)["error"]["code"]
    except Exception:  # noqa: BLE001 - not our error shape
        return None
