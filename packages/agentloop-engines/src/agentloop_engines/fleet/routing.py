"""The routing policy behind :class:`~agentloop_engines.fleet.client.LLMServerClient`.

Kept apart from the client (no I/O, no asyncio) so that a benchmark can replay request traces
through different policies and compare load spread and prefix-cache reuse.

The policy is *sticky and load-aware*:

* **least in-flight**: a new session goes to the healthy replica with the fewest requests in
  flight (ties go to the replica that has served fewest requests in total, so an idle pool is
  filled round-robin rather than always starting at replica 0);
* **sticky session**: later requests with the same ``request_id`` go back to the same replica,
  whose prefix cache already holds the trajectory's earlier turns;
* **cost-model gate**: stickiness is abandoned (and the session re-pinned) when serving the
  request on the least-loaded replica is expected to be faster *including* re-prefilling its
  whole prompt there. Expected time on a replica = (prompt tokens it must prefill x
  ``prefill_token_cost`` + ``expected_decode_tokens``) x its batch slowdown, where the slowdown
  is ``max(1, (in flight + 1) / saturation_batch)``: an engine serves up to
  ``saturation_batch`` requests at full per-request speed and shares its throughput beyond
  that. The pinned replica only prefills what is new since the session's previous prompt; any
  other replica prefills everything. So a long trajectory (a costly prefix) moves only off a
  much busier replica, a fresh one moves readily, and nothing moves while every replica is
  below saturation (there is no wait to save). Pure stickiness never migrates, so a long tail
  of multi-turn trajectories can pile onto whichever replica started them; pure hashing loses
  the prefix cache;
* **count gate** (when the prompt length is not known, e.g. a chat request): move when the
  pinned replica has more than ``imbalance_threshold`` requests in flight beyond the
  least-loaded one;
* **probed recovery**: a replica taken out of rotation is sent one real request (a probe) once
  its backoff has passed; the backoff doubles, up to a cap, each time a probe fails, and a probe
  that succeeds puts the replica back. A probe that fails is retried on another replica like any
  failover, so recovering costs at most one retry per backoff period, while never probing would
  leave a replica that restarted (or had a network blip) out for the rest of the run. With no
  replica left in rotation for a request, the one due soonest is probed at once rather than
  refusing the request until its backoff ends (one probe per replica at a time still holds);
* **stale replicas** (:meth:`~StickyLeastInFlightPolicy.set_stale`) are out of rotation and never
  probed: they missed a weight push, so any answer of theirs would be on old weights;
* **suspects** (:meth:`~StickyLeastInFlightPolicy.suspect`): a replica that let one request
  time out without completing anything meanwhile stays in rotation but is routed to only when
  no other replica is left, until it completes a request or the client decides (see
  :class:`~agentloop_engines.fleet.client.LLMServerClient`); **busy** ones (a 503 from their in-flight
  limit, :meth:`~StickyLeastInFlightPolicy.note_busy`) likewise until their ``Retry-After``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection
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
    """Sticky requests moved off an overloaded replica (by the cost model or the count gate)."""
    rerouted: int = 0
    """Sticky requests moved because their replica was unhealthy or excluded (failover)."""
    probes: int = 0
    """Requests sent to an out-of-rotation replica to test whether it is back."""
    recoveries: int = 0
    """Replicas put back into rotation by a successful probe."""
    early_probes: int = 0
    """Probes sent before their backoff ended because no replica was left in rotation."""
    per_replica: list[int] = field(default_factory=list)
    """Requests routed to each replica."""


class NoHealthyReplicaError(RuntimeError):
    """Every replica is out of rotation (or was already tried for this request)."""


class RequestTimeoutError(RuntimeError):
    """A request ran past ``request_timeout_s`` on every replica it tried, and none of them was
    shown to hang (each served other requests meanwhile, or no other replica served this one
    faster): the request is too slow for the limit. The replicas stay in rotation."""


class StickyLeastInFlightPolicy:
    """Least in-flight routing with sticky sessions and a prefix-cost-aware migration gate.

    The caller brackets each request with :meth:`acquire` / :meth:`release` (release in a
    ``finally`` so errors, timeouts and aborts all give the slot back).

    Args:
        num_replicas: How many replicas there are; they are addressed by index.
        sticky_capacity: Sessions remembered (LRU); the least recently used one is forgotten
            first, and its next request is routed as a new session.
        imbalance_threshold: When the prompt length is not given: move a sticky request to
            the least-loaded replica when its replica has more than this many extra requests in
            flight. None: never move a sticky request because of load (pure stickiness), with
            or without a prompt length.
        saturation_batch: Requests one replica serves at full per-request speed; beyond it
            each request slows by ``in_flight / saturation_batch`` (the knee of the engine's
            throughput-vs-batch curve; larger on a big GPU, smaller on a CPU).
        prefill_token_cost: Cost of prefilling one prompt token relative to generating one
            token (prefill is batched over the prompt, so far cheaper: 0.01-0.1 is typical).
        expected_decode_tokens: Tokens a turn is expected to generate (the part of a request's
            cost that does not depend on where it runs).
        probe_backoff_s: Wait before the first probe of a replica taken out of rotation.
        max_probe_backoff_s: Cap of the backoff, which doubles after every failed probe.
        clock: Monotonic time source (a fake one makes backoff testable without sleeping).

    Raises:
        ValueError: on ``num_replicas < 1``, ``sticky_capacity < 1``, a negative threshold,
            cost-model parameters that are not positive, or a backoff that is not positive.
    """

    def __init__(self, num_replicas: int, *, sticky_capacity: int = 10000,
                 imbalance_threshold: int | None = 8, probe_backoff_s: float = 5.0,
                 max_probe_backoff_s: float = 60.0, saturation_batch: int = 32,
                 prefill_token_cost: float = 0.05, expected_decode_tokens: int = 256,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if num_replicas < 1:
            raise ValueError(f"need at least one replica, got num_replicas={num_replicas}")
        if sticky_capacity < 1:
            raise ValueError(f"sticky_capacity must be >= 1, got {sticky_capacity}")
        if imbalance_threshold is not None and imbalance_threshold < 0:
            raise ValueError(
                f"imbalance_threshold must be >= 0 or None (never migrate), got {imbalance_threshold}"
            )
        if saturation_batch < 1 or prefill_token_cost <= 0 or expected_decode_tokens < 1:
            raise ValueError(
                "need saturation_batch >= 1, prefill_token_cost > 0 and expected_decode_tokens >= 1, "
                f"got {saturation_batch}, {prefill_token_cost} and {expected_decode_tokens}"
            )
        if not 0 < probe_backoff_s <= max_probe_backoff_s:
            raise ValueError(
                f"need 0 < probe_backoff_s <= max_probe_backoff_s, got {probe_backoff_s} and "
                f"{max_probe_backoff_s}"
            )
        self.num_replicas = num_replicas
        self.probe_backoff_s = probe_backoff_s
        self.max_probe_backoff_s = max_probe_backoff_s
        self._clock = clock
        self._backoff: list[float] = [0.0] * num_replicas
        self._retry_at: list[float] = [0.0] * num_replicas
        self._probing: list[bool] = [False] * num_replicas
        self.imbalance_threshold = imbalance_threshold
        self.saturation_batch = saturation_batch
        self.prefill_token_cost = prefill_token_cost
        self.expected_decode_tokens = expected_decode_tokens
        self.in_flight: list[int] = [0] * num_replicas
        self.healthy: list[bool] = [True] * num_replicas
        self.stale: list[bool] = [False] * num_replicas
        self.completed: list[int] = [0] * num_replicas
        """Requests each replica served (:meth:`record_success`): a sign of life while one of
        its requests timed out."""
        self._suspects: list[set[int]] = [set() for _ in range(num_replicas)]
        self._next_token = 0
        self._busy_until: list[float] = [0.0] * num_replicas
        self.stats = RoutingStats(per_replica=[0] * num_replicas)
        # request_id -> (replica, prompt tokens of the session's last request there): what that
        # replica's prefix cache is assumed to hold (at least; it also cached the output).
        self._sessions: LRUCache[str, tuple[int, int]] = LRUCache(maxsize=sticky_capacity)

    # ---- health ---------------------------------------------------------------------------

    @property
    def healthy_replicas(self) -> list[int]:
        """Indices of the replicas in rotation."""
        return [i for i, ok in enumerate(self.healthy) if ok]

    def mark_unhealthy(self, index: int, *, probe: bool = True) -> None:
        """Take replica ``index`` out of rotation until a probe succeeds; its sessions move on
        their next request. Marking an already unhealthy replica (a failed probe) doubles its
        backoff, up to ``max_probe_backoff_s``.

        Args:
            index: The replica.
            probe: False keeps it out until :meth:`mark_healthy` (e.g. it missed a weight
                update, so answering a probe would not make its outputs right).
        """
        self._check_index(index)
        if self.healthy[index]:
            self._backoff[index] = self.probe_backoff_s
        else:
            self._backoff[index] = min(2 * self._backoff[index], self.max_probe_backoff_s)
        self.healthy[index] = False
        self._probing[index] = False
        self._suspects[index].clear()
        self._retry_at[index] = self._clock() + self._backoff[index] if probe else float("inf")

    def mark_healthy(self, index: int) -> None:
        """Put replica ``index`` back into rotation (also when stale: the caller vouches that it
        holds the current weights)."""
        self._check_index(index)
        self.healthy[index] = True
        self.stale[index] = False
        self._probing[index] = False
        self._suspects[index].clear()
        self._backoff[index] = 0.0

    def set_stale(self, index: int, stale: bool) -> None:
        """Mark replica ``index`` as holding old weights (True: out of rotation, never probed)
        or as current again (False: a replica that is out is probed at once, unless it was
        taken out with ``probe=False``)."""
        self._check_index(index)
        if stale:
            if self.healthy[index]:
                self.mark_unhealthy(index)
            self.stale[index] = True
            self._probing[index] = False
        elif self.stale[index]:
            self.stale[index] = False
            if not self.healthy[index] and self._retry_at[index] != float("inf"):
                self._retry_at[index] = min(self._retry_at[index], self._clock())

    def record_success(self, index: int) -> None:
        """Report that replica ``index`` served a request; an out-of-rotation one is back, and
        a suspect one is cleared."""
        self._check_index(index)
        self.completed[index] += 1
        self._suspects[index].clear()
        if not self.healthy[index]:
            self.mark_healthy(index)
            self.stats.recoveries += 1

    def suspect(self, index: int) -> int:
        """Suspect replica ``index`` of hanging (a request timed out there while it completed
        nothing); returns a token for :meth:`is_suspected` / :meth:`clear_suspicion`. A suspect
        stays in rotation but is chosen only when no other replica is left."""
        self._check_index(index)
        self._next_token += 1
        self._suspects[index].add(self._next_token)
        return self._next_token

    def is_suspected(self, index: int, token: int) -> bool:
        """Whether the suspicion ``token`` still stands (nothing completed on ``index`` since)."""
        return token in self._suspects[index]

    def clear_suspicion(self, index: int, token: int) -> None:
        """Drop the suspicion ``token`` (its request ended without settling it)."""
        self._suspects[index].discard(token)

    def note_busy(self, index: int, retry_after_s: float) -> None:
        """Replica ``index`` refused a request at its in-flight limit: prefer others for
        ``retry_after_s`` (it stays in rotation; backpressure is not a failure)."""
        self._check_index(index)
        self._busy_until[index] = max(self._busy_until[index], self._clock() + retry_after_s)

    def probes_in_flight(self, exclude: Collection[int] = ()) -> list[int]:
        """Out-of-rotation replicas outside ``exclude`` whose probe is running now."""
        return [i for i in range(self.num_replicas) if self._probing[i] and i not in exclude]

    def next_probe_in(self, index: int) -> float | None:
        """Seconds until replica ``index`` is probed (0 when due); None when it is healthy or
        is never probed (taken out with ``probe=False``, or stale)."""
        self._check_index(index)
        if self.healthy[index] or self.stale[index] or self._retry_at[index] == float("inf"):
            return None
        return max(0.0, self._retry_at[index] - self._clock())

    # ---- routing --------------------------------------------------------------------------

    def session_replica(self, request_id: str) -> int | None:
        """The replica ``request_id`` is pinned to, or None (does not refresh its LRU age)."""
        session = self._sessions.get(request_id)
        return session[0] if session is not None else None

    def forget(self, request_id: str) -> None:
        """Drop the session of ``request_id`` (e.g. when its trajectory is finished)."""
        self._sessions.pop(request_id, None)

    def expected_cost(self, index: int, prefill_tokens: int) -> float:
        """Expected time (in decode-token units) to serve one more request on ``index`` that
        must prefill ``prefill_tokens`` there: its work times the replica's batch slowdown."""
        slowdown = max(1.0, (self.in_flight[index] + 1) / self.saturation_batch)
        return (prefill_tokens * self.prefill_token_cost + self.expected_decode_tokens) * slowdown

    def choose(self, request_id: str, exclude: Collection[int] = (), *,
               prompt_tokens: int | None = None) -> int:
        """Pick the replica for one request of ``request_id`` and pin the session to it.

        Args:
            request_id: The trajectory's request id (the sticky-session key).
            exclude: Replicas not to use for this attempt (already failed for it).
            prompt_tokens: Length of the request's prompt; enables the cost-model gate (None:
                the count gate decides).

        Returns:
            The replica index.

        Raises:
            NoHealthyReplicaError: when no healthy replica outside ``exclude`` is left.
        """
        now = self._clock()
        # One probe at a time per replica: a still-broken replica costs one retry, not many.
        probeable = [i for i in range(self.num_replicas)
                     if not self.healthy[i] and not self.stale[i] and not self._probing[i]
                     and i not in exclude and self._retry_at[i] != float("inf")]
        due = [i for i in probeable if self._retry_at[i] <= now]
        candidates = [i for i in range(self.num_replicas) if self.healthy[i] and i not in exclude]
        if not due and not candidates and probeable:
            # Nothing in rotation for this request: probing now beats refusing it until the
            # backoff ends (the replicas may well be back: a blip takes them all out at once).
            due = probeable
            self.stats.early_probes += 1
        if due:
            choice = min(due, key=lambda i: self._retry_at[i])
            self._probing[choice] = True
            self.stats.probes += 1
            return self._pin(request_id, choice, prompt_tokens)
        if not candidates:
            out = {i: ("stale: missed a weight push" if self.stale[i] else "probe running" if self._probing[i]
                       else "held out until mark_healthy") for i in range(self.num_replicas)
                   if not self.healthy[i] and i not in exclude}
            raise NoHealthyReplicaError(
                f"no replica left to route request {request_id!r}: healthy={self.healthy_replicas}, "
                f"already tried={sorted(exclude)}, out of rotation={out}; check the engine logs, then "
                "restart the replicas or call mark_healthy(index) once they are back"
            )
        # Suspects and busy replicas take requests only when nothing else is left.
        preferred = [i for i in candidates if not self._suspects[i] and self._busy_until[i] <= now]
        candidates = preferred or candidates
        least = min(candidates, key=lambda i: (self.in_flight[i], self.stats.per_replica[i], i))
        session = self._sessions.get(request_id)
        pinned, cached = session if session is not None else (None, 0)
        if pinned is None:
            self.stats.new_sessions += 1
            choice = least
        elif pinned not in candidates:
            self.stats.rerouted += 1
            choice = least
        elif pinned != least and self._should_migrate(pinned, least, cached, prompt_tokens):
            self.stats.migrations += 1
            choice = least
        else:
            self.stats.sticky_hits += 1
            choice = pinned
        return self._pin(request_id, choice, prompt_tokens)

    def _should_migrate(self, pinned: int, least: int, cached: int, prompt_tokens: int | None) -> bool:
        if self.imbalance_threshold is None:
            return False
        if prompt_tokens is None:
            return self.in_flight[pinned] - self.in_flight[least] > self.imbalance_threshold
        # Staying prefills only what is new since the last prompt; moving prefills it all.
        stay = self.expected_cost(pinned, max(0, prompt_tokens - cached))
        return self.expected_cost(least, prompt_tokens) < stay

    def _pin(self, request_id: str, choice: int, prompt_tokens: int | None = None) -> int:
        self._sessions[request_id] = (choice, prompt_tokens or 0)
        self.stats.routed += 1
        self.stats.per_replica[choice] += 1
        return choice

    def acquire(self, index: int) -> None:
        """Count one more request in flight on ``index``."""
        self.in_flight[index] += 1

    def release(self, index: int) -> None:
        """Count one request fewer in flight on ``index`` (ending its probe, if it was one)."""
        if self.in_flight[index] <= 0:
            # A release without an acquire would hide a leak elsewhere; fail loudly.
            raise RuntimeError(f"release() on replica {index} with no request in flight")
        self.in_flight[index] -= 1
        self._probing[index] = False

    def _check_index(self, index: int) -> None:
        if not 0 <= index < self.num_replicas:
            raise IndexError(f"replica index {index} out of range [0, {self.num_replicas})")
