"""The routing policies the routing benchmark compares, behind one small interface.

Each policy answers ``choose(request_id, prompt_tokens) -> replica index`` and is told when a
request starts (``acquire``) and ends (``release``). ``ours`` is the real
:class:`agentloop_engines.fleet.routing.StickyLeastInFlightPolicy` as ``LLMServerClient`` uses it
(given each prompt's length, so its cost-model gate decides migrations); "sticky least
in-flight, count gate" is the same class without prompt lengths (the previous default: move
when 8 more requests are in flight). The others are the usual alternatives, written here for
the comparison only.
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

    def choose(self, request_id: str, prompt_tokens: int | None = None) -> int:
        index = self._next
        self._next = (self._next + 1) % self.num_replicas
        return index


class Random(_Counting):
    """A uniformly random replica per request (seeded)."""

    def __init__(self, num_replicas: int, seed: int = 0) -> None:
        super().__init__(num_replicas)
        self._rng = random.Random(seed)

    def choose(self, request_id: str, prompt_tokens: int | None = None) -> int:
        return self._rng.randrange(self.num_replicas)


class CumulativeLeastRequests(_Counting):
    """The replica that was sent the fewest requests so far; the counter is never decremented
    when a request ends (so it balances request counts, not load)."""

    def __init__(self, num_replicas: int) -> None:
        super().__init__(num_replicas)
        self.sent = [0] * num_replicas

    def choose(self, request_id: str, prompt_tokens: int | None = None) -> int:
        index = min(range(self.num_replicas), key=lambda i: (self.sent[i], i))
        self.sent[index] += 1
        return index


class LeastInFlight(_Counting):
    """The replica with the fewest requests in flight, without stickiness."""

    def choose(self, request_id: str, prompt_tokens: int | None = None) -> int:
        return min(range(self.num_replicas), key=lambda i: (self.in_flight[i], i))


class HashSticky(_Counting):
    """A fixed replica per request id (hash of the id): every turn hits the same cache, load is
    whatever the hash gives."""

    def choose(self, request_id: str, prompt_tokens: int | None = None) -> int:
        digest = hashlib.blake2b(request_id.encode(), digest_size=8).digest()
        return int.from_bytes(digest, "little") % self.num_replicas


class Ours:
    """``StickyLeastInFlightPolicy`` with its defaults, as the client drives it: least in-flight
    for new sessions, sticky afterwards, migrate when the least-loaded replica serves the request
    faster even after re-prefilling its whole prompt (cost model)."""

    uses_prompt_length = True

    def __init__(self, num_replicas: int, **kwargs) -> None:
        from agentloop_engines.fleet.routing import StickyLeastInFlightPolicy

        self.policy = StickyLeastInFlightPolicy(num_replicas, **kwargs)

    def choose(self, request_id: str, prompt_tokens: int | None = None) -> int:
        return self.policy.choose(request_id, prompt_tokens=prompt_tokens if self.uses_prompt_length else None)

    def acquire(self, index: int) -> None:
        self.policy.acquire(index)

    def release(self, index: int) -> None:
        self.policy.release(index)


class CountGate(Ours):
    """The previous default: the same policy never told the prompt length, so a sticky request
    moves when its replica has more than 8 requests in flight beyond the least-loaded one."""

    uses_prompt_length = False


POLICIES = {
    "round robin": RoundRobin,
    "random": Random,
    "cumulative least-requests": CumulativeLeastRequests,
    "least in-flight (no sticky)": LeastInFlight,
    "hash-sticky": HashSticky,
    "sticky least in-flight, count gate (old default)": CountGate,
    "ours: sticky least in-flight, cost-model gate": Ours,
}


class ClairvoyantLane(HashSticky):
    """NOT a policy (it knows the future): the given trajectories alone on the last replica, the
    rest hash-sticky over the others. Measures how much makespan routing could still win by
    isolating the trajectories that turn out longest."""

    def __init__(self, num_replicas: int, lane: set[str]) -> None:
        super().__init__(num_replicas)
        self.lane = lane

    def choose(self, request_id: str, prompt_tokens: int | None = None) -> int:
        if request_id in self.lane:
            return self.num_replicas - 1
        digest = hashlib.blake2b(request_id.encode(), digest_size=8).digest()
        return int.from_bytes(digest, "little") % (self.num_replicas - 1)
