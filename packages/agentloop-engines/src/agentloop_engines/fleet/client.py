"""``LLMServerClient``: one ``AsyncServer`` in front of several engine replicas.

Routing is least in-flight with sticky sessions and a prefix-cost-aware migration gate (see
:mod:`agentloop_engines.fleet.routing`); failures of a replica (connection errors, a dead Ray actor)
take it out of rotation and the request is retried on another one. Three things are not
failures of a replica:

* a 503 from its in-flight limit (:class:`~agentloop_engines.fleet.http_client.ReplicaBusyError`) is
  backpressure: the request goes to another replica, or waits its ``Retry-After``;
* a request past ``request_timeout_s`` is retried elsewhere, but it convicts the replica only
  when another replica then serves the same request and the first completed nothing while it
  waited; a request that times out on every replica it tried is the request's fault and fails
  alone with :class:`RequestTimeoutError`;
* with no replica in rotation, a request probes one at once instead of being refused.

Weight pushes reach every replica, out of rotation too; one that misses a push (down, failing,
busy past ``busy_wait_s``) is *stale* (see :mod:`agentloop_engines.fleet.weight_ledger`): out of
rotation and never probed until a later push reaches it, so nothing is served on old weights.

``generate_stream`` routes a streamed request the same way, failing over only until its first
delta (see :mod:`agentloop_engines.fleet.client_stream`).

Replicas are either in-process ``AsyncServer`` objects or Ray actor handles of
:class:`~agentloop_engines.fleet.hosting.ReplicaActor`; the client itself runs wherever it is
constructed. To share one client (and so one global view of the load) between many workers,
host it as a Ray actor with :func:`agentloop_engines.fleet.hosting.client_actor`.

This module routes single requests; the calls made on every replica at once (weight pushes,
``sleep``/``wake_up``, ``abort``) are in :mod:`agentloop_engines.fleet.client_fanout`, the counters in
:mod:`agentloop_engines.fleet.client_stats`; every name is importable from here as before.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import AsyncGenerator, Mapping, Sequence
from dataclasses import fields
from typing import Any

from agentloop_core.protocol import SamplingParams, ServerCapabilities, TokenOutput
from agentloop_core.vision.content import images_of
from agentloop_engines.fleet.client_fanout import ReplicaFanOut
from agentloop_engines.fleet.client_stats import ClientStats
from agentloop_engines.fleet.client_stream import routed_stream
from agentloop_engines.fleet.http_client import ReplicaBusyError
from agentloop_engines.fleet.replica_calls import (
    MIN_BUSY_WAIT_S,
    Attempts,
    Replica,
    ReplicaCall,
    is_own_timeout,
    is_replica_failure,
)
from agentloop_engines.fleet.routing import (
    NoHealthyReplicaError,
    RequestTimeoutError,
    StickyLeastInFlightPolicy,
)
from agentloop_engines.fleet.weight_ledger import WeightLedger
from agentloop_engines.streaming import TokenDelta

logger = logging.getLogger(__name__)

__all__ = ["ClientStats", "LLMServerClient", "NoHealthyReplicaError", "RequestTimeoutError", "is_replica_failure"]


class LLMServerClient(ReplicaFanOut):
    """Balances requests over engine replicas; itself an ``AsyncServer``.

    Args:
        replicas: In-process ``AsyncServer`` objects and/or Ray actor handles of ``ReplicaActor``.
        sticky_capacity: Sessions (request ids) remembered for sticky routing (LRU).
        imbalance_threshold: For requests without a known prompt length (chat): a sticky
            request moves to the least-loaded replica when its own replica has more than this
            many extra requests in flight; None: never move any sticky request for load.
            Token requests use the policy's cost model (re-prefill cost vs batch slowdown).
        request_timeout_s: Per-attempt limit. Past it the replica is sent a best-effort abort
            and the request is retried elsewhere; the replica leaves rotation only if another
            one serves that request and it completed nothing meanwhile (it hangs). A request
            past the limit on every replica tried raises :class:`RequestTimeoutError` and
            takes no replica out. None: no limit (agentic generations can be long; the rollout
            timeout is the backstop).
        max_retries: Re-sends after replica failures per request; None: try every replica once.
            With 0 (or one replica) a timeout never takes a replica out: nothing shows it hangs.
        retry_on: Extra exception types that count as replica failures (e.g. a transport's
            own connection error).
        capabilities_timeout_s: Limit on fetching a Ray replica's capabilities at construction.
        probe_backoff_s: An out-of-rotation replica is sent one request (a probe) after this
            long; a success puts it back, a failure retries the request elsewhere.
        max_probe_backoff_s: Cap of the probe backoff, which doubles after each failed probe.
        busy_wait_s: How long one request (or one replica's part of a weight push) waits out
            503s from in-flight limits (each ``Retry-After``) before it gives up: the request
            with ``NoHealthyReplicaError``, the push by leaving that replica stale.
        offline_push_timeout_s: Limit on each ``update_weights`` call to a replica that is out
            of rotation (it may hang); past it that replica stays stale, out of rotation.

    Raises:
        ValueError: on an empty ``replicas`` list or bad routing parameters.
        TypeError: when an entry is neither an AsyncServer nor a ReplicaActor handle.
    """

    def __init__(
        self,
        replicas: Sequence[Any],
        *,
        sticky_capacity: int = 10000,
        imbalance_threshold: int | None = 8,
        request_timeout_s: float | None = None,
        max_retries: int | None = None,
        retry_on: tuple[type[BaseException], ...] = (),
        capabilities_timeout_s: float = 60.0,
        probe_backoff_s: float = 5.0,
        max_probe_backoff_s: float = 60.0,
        busy_wait_s: float = 60.0,
        offline_push_timeout_s: float = 120.0,
    ) -> None:
        replicas = list(replicas)
        if not replicas:
            raise ValueError("LLMServerClient needs at least one replica (got an empty list)")
        if request_timeout_s is not None and request_timeout_s <= 0:
            raise ValueError(f"request_timeout_s must be > 0 or None, got {request_timeout_s}")
        if max_retries is not None and max_retries < 0:
            raise ValueError(f"max_retries must be >= 0 or None, got {max_retries}")
        if not busy_wait_s >= 0 or not offline_push_timeout_s > 0:
            raise ValueError(f"need busy_wait_s >= 0 and offline_push_timeout_s > 0, got {busy_wait_s} and "
                             f"{offline_push_timeout_s}")
        self.replicas = replicas
        self._handles = [Replica(s, i, capabilities_timeout_s) for i, s in enumerate(replicas)]
        self.policy = StickyLeastInFlightPolicy(
            len(replicas), sticky_capacity=sticky_capacity, imbalance_threshold=imbalance_threshold,
            probe_backoff_s=probe_backoff_s, max_probe_backoff_s=max_probe_backoff_s,
        )
        self.request_timeout_s = request_timeout_s
        self.max_retries = len(replicas) - 1 if max_retries is None else max_retries
        self.retry_on = tuple(retry_on)
        self.busy_wait_s = busy_wait_s
        self.offline_push_timeout_s = offline_push_timeout_s
        self.weights = WeightLedger(len(replicas))
        """Which replicas hold the latest pushed value of every weight."""
        self._instances: list[str | None] = [None] * len(replicas)
        self.client_stats = ClientStats()
        self.capabilities = ServerCapabilities(**{
            f.name: all(getattr(r.capabilities, f.name) for r in self._handles)
            for f in fields(ServerCapabilities)
        } | {"forget_session": True})  # the client's own sticky slots, whatever the replicas keep
        self._background: set[asyncio.Task[Any]] = set()

    # ---- state ----------------------------------------------------------------------------

    @property
    def in_flight(self) -> list[int]:
        """Requests in flight on each replica."""
        return list(self.policy.in_flight)

    @property
    def stats(self) -> dict[str, Any]:
        """A snapshot of routing and client counters, per-replica load and health."""
        snap = dataclasses.asdict(self.policy.stats)
        snap.update(dataclasses.asdict(self.client_stats))
        snap["in_flight"] = self.in_flight
        snap["healthy"] = list(self.policy.healthy)
        snap["unhealthy"] = [not ok for ok in self.policy.healthy]
        snap["next_probe_in_s"] = [self.policy.next_probe_in(i) for i in range(len(self._handles))]
        snap["stale"] = list(self.policy.stale)
        snap["weight_pushes"] = self.weights.pushes
        return snap

    def mark_healthy(self, index: int) -> None:
        """Put a replica back into rotation (after it was restarted or recovered), stale or
        not: call it only once the replica holds the current weights."""
        self.policy.mark_healthy(index)
        self.weights.forget(index)

    def forget_session(self, request_id: str) -> None:
        """Drop the sticky session of a finished trajectory, freeing its LRU slot early, and
        tell the replica it was pinned to (when that replica declares
        ``capabilities.forget_session``; a Ray replica is sent the call without waiting)."""
        index = self.policy.session_replica(request_id)
        self.policy.forget(request_id)
        if index is None or not self._handles[index].capabilities.forget_session:
            return
        self._handles[index].forget(request_id)

    # ---- routed calls ---------------------------------------------------------------------

    async def generate(
        self,
        request_id: str,
        prompt_ids: list[int],
        sampling_params: Mapping[str, Any] | SamplingParams | None = None,
        *,
        multi_modal_data: Mapping[str, Any] | None = None,
    ) -> TokenOutput:
        """Generate on one replica, chosen by the routing policy, failing over when it dies.

        Args:
            request_id: The trajectory id: the sticky-session key and what ``abort`` targets.
            prompt_ids: The full prompt as token ids.
            sampling_params: A mapping or :class:`SamplingParams` (validated here first, so a
                typo fails before any replica is touched).
            multi_modal_data: The prompt's images (``{"image": [ImageItem, ...]}``), passed to
                the replica; every replica must declare ``capabilities.vision``.

        Returns:
            The replica's output; ``extra["replica"]`` names the replica index that served it.

        Raises:
            ValueError: bad sampling parameters or a request a replica rejected (not retried).
            NoHealthyReplicaError: every replica failed or is out of rotation (or kept refusing
                at its in-flight limit for ``busy_wait_s``).
            RequestTimeoutError: the request ran past ``request_timeout_s`` on every replica it
                tried, none of them shown to hang (they stay in rotation).
        """
        sp = SamplingParams.from_mapping(sampling_params)
        prompt_ids = list(prompt_ids)
        kwargs = self._multi_modal(multi_modal_data)
        return await self._routed(request_id, ReplicaCall("generate", (request_id, prompt_ids, sp), kwargs),
                                  prompt_tokens=len(prompt_ids))

    def generate_stream(
        self,
        request_id: str,
        prompt_ids: list[int],
        sampling_params: Mapping[str, Any] | SamplingParams | None = None,
        *,
        multi_modal_data: Mapping[str, Any] | None = None,
    ) -> AsyncGenerator[TokenDelta, None]:
        """Generate like :meth:`generate`, yielding the replica's tokens as it decodes them
        (``multi_modal_data`` as in :meth:`generate`).

        Routed as :meth:`generate` is; failover and retries happen only until the first delta
        arrives, ``request_timeout_s`` limits the wait for the first delta and then each gap
        between deltas, and closing the stream aborts the request on its replica (see
        :mod:`agentloop_engines.fleet.client_stream`).

        Before the first delta it raises what :meth:`generate` raises; after it, the replica's
        error as is (the tokens already yielded cannot be taken back, so nothing is retried).
        """
        kwargs = self._multi_modal(multi_modal_data)
        return routed_stream(self, request_id, list(prompt_ids), SamplingParams.from_mapping(sampling_params), kwargs)

    def _multi_modal(self, multi_modal_data: Mapping[str, Any] | None) -> dict[str, Any]:
        """The keyword arguments that carry a request's images to its replica (none for a text
        prompt); images need every replica to declare ``vision``."""
        if not images_of(multi_modal_data):
            return {}
        self._require("vision")
        return {"multi_modal_data": multi_modal_data}

    async def _routed(self, request_id: str, call: ReplicaCall, *, prompt_tokens: int | None = None) -> Any:
        attempt = Attempts(request_id)
        try:
            return await self._route(attempt, call, prompt_tokens)
        finally:
            for index, token in attempt.suspects:
                self.policy.clear_suspicion(index, token)

    async def _route(self, attempt: Attempts, call: ReplicaCall, prompt_tokens: int | None) -> Any:
        request_id = attempt.request_id
        busy_deadline = asyncio.get_running_loop().time() + self.busy_wait_s
        while True:
            try:
                index = self.policy.choose(request_id, exclude=attempt.excluded(), prompt_tokens=prompt_tokens)
            except NoHealthyReplicaError as exc:
                if await self._wait_for_probes(attempt):
                    continue
                if attempt.busy and await self._wait_busy(attempt, busy_deadline):
                    continue
                self.client_stats.failed += 1
                raise self._give_up(attempt, str(exc)) from None
            replica = self._handles[index]
            was_probe = not self.policy.healthy[index]
            completed_before = self.policy.completed[index]
            self.policy.acquire(index)
            held = False  # a stream keeps its in-flight slot until it ends (the caller releases it)
            try:
                coro = call.run(replica)
                if self.request_timeout_s is None:
                    result = await coro
                else:
                    result = await asyncio.wait_for(coro, self.request_timeout_s)
                held = call.holds
            except ReplicaBusyError as exc:
                # Backpressure: alive and serving others. Not a failure; try elsewhere or later.
                self.client_stats.busy += 1
                self.policy.note_busy(index, exc.retry_after_s)
                attempt.busy[index] = exc.retry_after_s
                continue
            except Exception as exc:
                if not (is_replica_failure(exc) or isinstance(exc, self.retry_on)):
                    self.client_stats.failed += 1
                    raise
                attempt.tried.append(index)
                if is_own_timeout(exc):
                    attempt.failures.append(self._on_timeout(replica, attempt, exc, was_probe=was_probe,
                                                             alive=self.policy.completed[index] > completed_before))
                else:
                    attempt.only_timeouts = False
                    attempt.failures.append(self._on_replica_failure(replica, request_id, exc,
                                                                     was_probe=was_probe))
                if len(attempt.tried) > self.max_retries:
                    self.client_stats.failed += 1
                    raise self._give_up(attempt, f"request {request_id!r} failed on {len(attempt.tried)} "
                                        f"replica(s) (max_retries={self.max_retries})") from exc
                self.client_stats.retries += 1
                continue
            finally:
                if not held:
                    self.policy.release(index)
            if self._restarted(index, call.instance(replica, result)):
                # Served, but by an engine that restarted from its checkpoint since the last push:
                # old weights. It is stale now; the request goes elsewhere.
                if held:
                    try:
                        await call.discard(result)
                    finally:
                        self.policy.release(index)
                attempt.tried.append(index)
                attempt.only_timeouts = False
                attempt.failures.append(f"replica {index} restarted and lost the pushed weights (held out until a "
                                        "push reaches it)")
                if len(attempt.tried) > self.max_retries:
                    self.client_stats.failed += 1
                    raise self._give_up(attempt, f"request {request_id!r} failed on {len(attempt.tried)} "
                                        f"replica(s) (max_retries={self.max_retries})")
                self.client_stats.retries += 1
                continue
            self.policy.record_success(index)
            if not held:  # a stream counts once it has ended
                self.client_stats.completed += 1
            self._convict_suspects(attempt, index)
            if isinstance(result, TokenOutput):
                result = dataclasses.replace(result, extra={**result.extra, "replica": index})
            return result

    def _on_timeout(self, replica: Replica, attempt: Attempts, exc: BaseException, *,
                    was_probe: bool, alive: bool) -> str:
        index = replica.index
        self.client_stats.timeouts += 1
        # The replica may still be working on it; stop it so it does not finish later.
        self._spawn(self._quiet_abort(replica, attempt.request_id))
        what = f"timed out after {self.request_timeout_s}s" if not str(exc) else f"{type(exc).__name__}: {exc}"
        if was_probe:
            # It was out of rotation already; a probe that does not answer keeps it out.
            attempt.only_timeouts = False
            return self._on_replica_failure(replica, attempt.request_id, exc, was_probe=True)
        if alive:
            return f"replica {index} {what} (it served other requests meanwhile: the request is slow)"
        if self.policy.healthy[index]:
            # No sign of life during the wait: a suspect until this request is served elsewhere
            # (then it hangs) or times out everywhere (then the request is slow).
            attempt.suspects.append((index, self.policy.suspect(index)))
        return f"replica {index} {what}"

    def _convict_suspects(self, attempt: Attempts, served_by: int) -> None:
        for index, token in attempt.suspects:
            if self.policy.is_suspected(index, token) and self.policy.healthy[index]:
                self.client_stats.replica_failures += 1
                self.policy.mark_unhealthy(index)
                logger.warning("replica %d taken out of rotation: request %r timed out there after %ss while it "
                               "completed nothing, and replica %d served it", index, attempt.request_id,
                               self.request_timeout_s, served_by)

    async def _wait_for_probes(self, attempt: Attempts) -> bool:
        """Wait for probes other requests are running on replicas this one has not tried;
        True when there were any (those still out afterwards are not probed again by it)."""
        probing = self.policy.probes_in_flight(attempt.excluded())
        if not probing:
            return False
        loop = asyncio.get_running_loop()
        deadline = loop.time() + (self.request_timeout_s or float("inf"))
        delay = 0.005
        while set(probing) & set(self.policy.probes_in_flight()) and loop.time() < deadline:
            await asyncio.sleep(delay)
            delay = min(2 * delay, 0.1)
        for i in probing:
            if not self.policy.healthy[i]:
                attempt.waited.append(i)
                attempt.only_timeouts = False
                attempt.failures.append(f"replica {i} failed a probe another request sent")
        return True

    async def _wait_busy(self, attempt: Attempts, deadline: float) -> bool:
        """Wait out the shortest ``Retry-After`` of the replicas that refused this request at
        their in-flight limit, then let it try them again; False past ``busy_wait_s``."""
        loop = asyncio.get_running_loop()
        wait = max(MIN_BUSY_WAIT_S, min(attempt.busy.values()))
        if loop.time() + wait > deadline:
            attempt.only_timeouts = False
            attempt.failures.append(f"replicas {sorted(attempt.busy)} answered 503 at their in-flight limit for "
                                    f"busy_wait_s={self.busy_wait_s}s (raise the replicas' max_in_flight, lower "
                                    "the rollout's concurrency, or raise busy_wait_s)")
            return False
        await asyncio.sleep(wait)
        attempt.busy.clear()
        return True

    def _give_up(self, attempt: Attempts, headline: str) -> RuntimeError:
        detail = "; ".join(attempt.failures) or "none tried"
        hint = "" if "mark_healthy" in headline else ("; check the engine logs, then restart the replicas or call "
                                                      "mark_healthy(index) once they are back")
        if attempt.only_timeouts and attempt.failures:
            self.client_stats.request_timeouts += 1
            return RequestTimeoutError(
                f"request {attempt.request_id!r} ran past request_timeout_s={self.request_timeout_s}s on every "
                f"replica it tried ({detail}); no replica was shown to hang, so they stay in rotation: the "
                "request is too slow for the limit (raise LLMServerClient(request_timeout_s=...) or lower its "
                "max_tokens)")
        return NoHealthyReplicaError(f"{headline}. Failures for this request: {detail}{hint}")
