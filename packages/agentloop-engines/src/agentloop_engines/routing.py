"""The routing policy behind :class:`~agentloop_engines.client.LLMServerClient`.

Kept apart from the client (no I/O, no asyncio) so that a benchmark can replay request traces
through different policies and compare load spread and prefix-cache reuse.

The policy is *sticky and load-aware*:

* **least in-flight**: a new session goes to the healthy replica with the fewest requests in
  flight (ties go to the replica that has served fewest requests in total, so an idle pool is
  filled round-robin rather than always starting at replica 0);
* **sticky session**: later requests with the same ``request_id`` go back to the same replica,
  whose prefix cache already holds the trajectory's earlier turns;
* **imbalance gate**: stickiness is abandoned (and the session re-pinned) when the pinned
  replica has more than ``imbalance_threshold`` requests in flight beyond the least-loaded one.
  Pure stickiness never migrates, so a long tail of multi-turn trajectories piles onto whichever
  replica happened to start them; pure hashing loses the prefix cache. The gate trades one
  prefix-cache miss for not queueing behind a hot replica.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field

from cachetools import LRUCache


@dataclass
class RoutingStats:
    """Counters of routing decisions (monotonic, never reset by the policy)."""

    routed: int = 0
    """Requests routed (each retry counts again)."""
    sticky_hits: int = 0
    """Requests sent to the replica their session was pinned to."""
    new_sessions: int = 0
    """Requests whose ``request_id`` had no pinned replica (first turn, or evicted from the LRU)."""
    migrations: int = 0
    """Sticky requests moved off an overloaded replica by the imbalance gate."""
    rerouted: int = 0
    """Sticky requests moved because their replica was unhealthy or excluded (failover)."""
    per_replica: list[int] = field(default_factory=list)
    """Requests routed to each replica."""


class NoHealthyReplicaError(RuntimeError):
    """Every replica is out of rotation (or was already tried for this request)."""


class StickyLeastInFlightPolicy:
    """Least in-flight routing with sticky sessions and an imbalance gate.

    The caller brackets each request with :meth:`acquire` / :meth:`release` (release in a
    ``finally`` so errors, timeouts and aborts all give the slot back).

    Args:
        num_replicas: How many replicas there are; they are addressed by index.
        sticky_capacity: Sessions remembered (LRU); the least recently used one is forgotten
            first, and its next request is routed as a new session.
        imbalance_threshold: Move a sticky request to the least-loaded replica when its
            replica has more than this many extra requests in flight; None never moves.

    Raises:
        ValueError: on ``num_replicas < 1``, ``sticky_capacity < 1`` or a negative threshold.
    """

    def __init__(self, num_replicas: int, *, sticky_capacity: int = 10000,
                 imbalance_threshold: int | None = 8) -> None:
        if num_replicas < 1:
            raise ValueError(f"need at least one replica, got num_replicas={num_replicas}")
        if sticky_capacity < 1:
            raise ValueError(f"sticky_capacity must be >= 1, got {sticky_capacity}")
        if imbalance_threshold is not None and imbalance_threshold < 0:
            raise ValueError(
                f"imbalance_threshold must be >= 0 or None (never migrate), got {imbalance_threshold}"
            )
        self.num_replicas = num_replicas
        self.imbalance_threshold = imbalance_threshold
        self.in_flight: list[int] = [0] * num_replicas
        self.healthy: list[bool] = [True] * num_replicas
        self.stats = RoutingStats(per_replica=[0] * num_replicas)
        self._sessions: LRUCache[str, int] = LRUCache(maxsize=sticky_capacity)

    # ---- health ---------------------------------------------------------------------------

    @property
    def healthy_replicas(self) -> list[int]:
        """Indices of the replicas in rotation."""
        return [i for i, ok in enumerate(self.healthy) if ok]

    def mark_unhealthy(self, index: int) -> None:
        """Take replica ``index`` out of rotation; its sessions move on their next request."""
        self._check_index(index)
        self.healthy[index] = False

    def mark_healthy(self, index: int) -> None:
        """Put replica ``index`` back into rotation."""
        self._check_index(index)
        self.healthy[index] = True

    # ---- routing --------------------------------------------------------------------------

    def session_replica(self, request_id: str) -> int | None:
        """The replica ``request_id`` is pinned to, or None (does not refresh its LRU age)."""
        return self._sessions.get(request_id) if request_id in self._sessions else None

    def forget(self, request_id: str) -> None:
        """Drop the session of ``request_id`` (e.g. when its trajectory is finished)."""
        self._sessions.pop(request_id, None)

    def choose(self, request_id: str, exclude: Collection[int] = ()) -> int:
        """Pick the replica for one request of ``request_id`` and pin the session to it.

        Args:
            request_id: The trajectory's request id (the sticky-session key).
            exclude: Replicas not to use for this attempt (already failed for it).

        Returns:
            The replica index.

        Raises:
            NoHealthyReplicaError: when no healthy replica outside ``exclude`` is left.
        """
        candidates = [i for i in range(self.num_replicas) if self.healthy[i] and i not in exclude]
        if not candidates:
            raise NoHealthyReplicaError(
                f"no replica left to route request {request_id!r}: healthy={self.healthy_replicas}, "
                f"already tried={sorted(exclude)}; check the engine logs, then restart the replicas "
                "or call mark_healthy(index) once they are back"
            )
        least = min(candidates, key=lambda i: (self.in_flight[i], self.stats.per_replica[i], i))
        pinned = self._sessions.get(request_id)
        if pinned is None:
            self.stats.new_sessions += 1
            choice = least
        elif pinned not in candidates:
            self.stats.rerouted += 1
            choice = least
        elif (self.imbalance_threshold is not None
              and self.in_flight[pinned] - self.in_flight[least] > self.imbalance_threshold):
            self.stats.migrations += 1
            choice = least
        else:
            self.stats.sticky_hits += 1
            choice = pinned
        self._sessions[request_id] = choice
        self.stats.routed += 1
        self.stats.per_replica[choice] += 1
        return choice

    def acquire(self, index: int) -> None:
        """Count one more request in flight on ``index``."""
        self.in_flight[index] += 1

    def release(self, index: int) -> None:
        """Count one request fewer in flight on ``index``."""
        if self.in_flight[index] <= 0:
            # A release without an acquire would hide a leak elsewhere; fail loudly.
            raise RuntimeError(f"release() on replica {index} with no request in flight")
        self.in_flight[index] -= 1

    def _check_index(self, index: int) -> None:
        if not 0 <= index < self.num_replicas:
            raise IndexError(f"replica index {index} out of range [0, {self.num_replicas})")
