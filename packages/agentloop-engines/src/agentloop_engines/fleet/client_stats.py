"""The counters of :class:`~agentloop_engines.fleet.client.LLMServerClient` (its ``client_stats``)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ClientStats"]


@dataclass
class ClientStats:
    """Counters of what the client did (monotonic)."""

    completed: int = 0
    """Requests that returned an output."""
    failed: int = 0
    """Requests that raised to the caller (bad input, engine error, or no replica left)."""
    retries: int = 0
    """Attempts re-sent to another replica after a replica failure."""
    replica_failures: int = 0
    """Replica failures seen (connection errors, dead actors, timeouts)."""
    timeouts: int = 0
    """Attempts that ran past ``request_timeout_s`` (or a transport's own read timeout)."""
    request_timeouts: int = 0
    """Requests failed with :class:`RequestTimeoutError` (slow on every replica tried)."""
    busy: int = 0
    """Attempts a replica refused at its in-flight limit (503 with ``Retry-After``); not failures."""
    missed_pushes: int = 0
    """Weight pushes (``update_weights`` calls) some replica missed, one count per replica."""

