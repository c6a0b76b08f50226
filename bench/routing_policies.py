"""The routing policies the routing benchmark compares, behind one small interface.

Each policy answers ``choose(request_id) -> replica index`` and is told when a request starts
(``acquire``) and ends (``release``). ``ours`` is the real
:class:`agentloop_engines.routing.StickyLeastInFlightPolicy` that ``LLMServerClient`` uses;
the others are the usual alternatives, written here for the comparison only.
"""

from __future__ import annotations

import hashlib
import random


class _Counting:
    def __init__(self, num_replicas: int) -> None:
        self.num_replicas = num_replicas
        self.in_flight = [0] * num_replicas

    def acquire(self, index: int) -> None:
        self.in_flight[index] += 1

    def release(self, index: int) -> None:
        self.in_flight[index] -= 1


class RoundRobin(_Counting):
    """Each request to the next replica in turn (no stickiness)."""

    def __init__(self, num_replicas: int) -> None:
        super().__init__(num_replicas)
        self._next = 0

    def choose(self, request_id: str) -> int:
        index = self._next
        self._next = (self._next + 1) % self.num_replicas
        return index


class Random(_Counting):
    """A uniformly random replica per request (seeded)."""

    def __init__(self, num_replicas: int, seed: int = 0) -> None:
        super().__init__(num_replicas)
        self._rng = random.Random(seed)

    def choose(self, request_id: str) -> int:
        return self._rng.randrange(self.num_replicas)


class CumulativeLeastRequests(_Counting):
    """The replica that was sent the fewest requests so far; the counter is never decremented
    when a request ends (so it balances request counts, not load)."""

    def __init__(self, num_replicas: int) -> None:
        super().__init__(num_replicas)
        self.sent = [0] * num_replicas

    def choose(self, request_id: str) -> int:
        index = min(range(self.num_replicas), key=lambda i: (self.sent[i], i))
        self.sent[index] += 1
        return index


class LeastInFlight(_Counting):
    """The replica with the fewest requests in flight, without stickiness."""

    def choose(self, request_id: str) -> int:
        return min(range(self.num_replicas), key=lambda i: (self.in_flight[i], i))


class HashSticky(_Counting):
    """A fixed replica per request id (hash of the id): every turn hits the same cache, load is
    whatever the hash gives."""

    def choose(self, request_id: str) -> int:
        digest = hashlib.blake2b(request_id.encode(), digest_size=8).digest()
        return int.from_bytes(digest, "little") % self.num_replicas


class Ours:
    """``StickyLeastInFlightPolicy`` (least in-flight for new sessions, sticky afterwards,
    migrate when the pinned replica is more than ``imbalance_threshold`` requests busier)."""

    def __init__(self, num_replicas: int, **kwargs) -> None:
        from agentloop_engines.routing import StickyLeastInFlightPolicy

        self.policy = StickyLeastInFlightPolicy(num_replicas, **kwargs)

    def choose(self, request_id: str) -> int:
        return self.policy.choose(request_id)

    def acquire(self, index: int) -> None:
        self.policy.acquire(index)

    def release(self, index: int) -> None:
        self.policy.release(index)


POLICIES = {
    "round robin": RoundRobin,
    "random": Random,
    "cumulative least-requests": CumulativeLeastRequests,
    "least in-flight (no sticky)": LeastInFlight,
    "hash-sticky": HashSticky,
    "ours (sticky least in-flight)": Ours,
}
