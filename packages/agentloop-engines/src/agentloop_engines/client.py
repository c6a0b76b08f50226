"""``LLMServerClient``: one ``AsyncServer`` in front of several engine replicas.

Routing is least in-flight with sticky sessions and a prefix-cost-aware migration gate (see
:mod:`agentloop_engines.routing`); failures of a replica (connection errors, a dead Ray actor,
a request timeout) take it out of rotation and the request is retried on another one.

Replicas are either in-process ``AsyncServer`` objects or Ray actor handles of
:class:`~agentloop_engines.hosting.ServerActor`; the client itself runs wherever it is
constructed. To share one client (and so one global view of the load) between many workers,
host it as a Ray actor with :func:`agentloop_engines.hosting.client_actor`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

from agentloop_core.protocol import (
    CapabilityNotSupportedError,
    SamplingParams,
    ServerCapabilities,
    TokenOutput,
)
from agentloop_engines.routing import NoHealthyReplicaError, StickyLeastInFlightPolicy

logger = logging.getLogger(__name__)

__all__ = ["ClientStats", "LLMServerClient", "NoHealthyReplicaError", "is_replica_failure"]

_RAY_FAILURE_NAMES = ("RayActorError", "WorkerCrashedError", "NodeDiedError", "OwnerDiedError")


def _ray_failure_types() -> tuple[type[BaseException], ...]:
    # Only look at ray if something already imported it: a replica can only be a Ray actor
    # then, and `import agentloop_engines.client` must not pull ray in.
    ray = sys.modules.get("ray")
    if ray is None:
        return ()
    exc_mod = getattr(ray, "exceptions", None)
    return tuple(t for name in _RAY_FAILURE_NAMES if (t := getattr(exc_mod, name, None)) is not None)


def is_replica_failure(exc: BaseException) -> bool:
    """Whether ``exc`` means the replica (not the request) is broken, so another may serve it.

    ValueError is never a replica failure: a request that fails validation fails everywhere.
    Connection errors, timeouts and dead Ray actors / workers / nodes are; so is an
    ``RemoteServer`` replica that is unreachable or answers 502/503/504: it raises
    ``ReplicaUnavailableError``, a ``ConnectionError``.
    """
    if isinstance(exc, ValueError):
        return False
    if isinstance(exc, (ConnectionError, TimeoutError, asyncio.TimeoutError)):
        return True
    ray_types = _ray_failure_types()
    return bool(ray_types) and isinstance(exc, ray_types)


def _is_actor_handle(obj: Any) -> bool:
    ray = sys.modules.get("ray")
    return ray is not None and isinstance(obj, ray.actor.ActorHandle)


class _Replica:
    """Uniform async calls on an in-process server or a Ray actor handle."""

    def __init__(self, target: Any, index: int, capabilities_timeout_s: float) -> None:
        self.target = target
        self.index = index
        self.is_actor = _is_actor_handle(target)
        if self.is_actor:
            import ray

            try:
                caps = ray.get(target.get_capabilities.remote(), timeout=capabilities_timeout_s)
            except AttributeError as exc:
                raise TypeError(
                    f"replica {index} is a Ray actor without get_capabilities(); host engines with "
                    "agentloop_engines.hosting.ServerActor (start_replicas does)"
                ) from exc
        else:
            if not callable(getattr(target, "generate", None)):
                raise TypeError(
                    f"replica {index} ({type(target).__name__}) has no generate(); pass AsyncServer "
                    "objects or Ray actor handles of ServerActor"
                )
            caps = getattr(target, "capabilities", None)
        if not isinstance(caps, ServerCapabilities):
            raise TypeError(
                f"replica {index} declares capabilities={caps!r}; an AsyncServer must set a "
                "ServerCapabilities instance"
            )
        self.capabilities = caps

    async def call(self, method: str, *args: Any) -> Any:
        if self.is_actor:
            return await getattr(self.target, method).remote(*args)
        return await getattr(self.target, method)(*args)


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
    """Attempts that ran past ``request_timeout_s``."""


class LLMServerClient:
    """Balances requests over engine replicas; itself an ``AsyncServer``.

    Args:
        servers: In-process ``AsyncServer`` objects and/or Ray actor handles of ``ServerActor``.
        sticky_capacity: Sessions (request ids) remembered for sticky routing (LRU).
        imbalance_threshold: For requests without a known prompt length (chat): a sticky
            request moves to the least-loaded replica when its own replica has more than this
            many extra requests in flight; None: never move any sticky request for load.
            Token requests use the policy's cost model (re-prefill cost vs batch slowdown).
        request_timeout_s: Per-attempt limit; a replica that exceeds it is treated as hung:
            taken out of rotation, sent a best-effort abort, and the request retried elsewhere.
            None: no limit (agentic generations can be long; the rollout timeout is the backstop).
        max_retries: Re-sends after replica failures per request; None: try every replica once.
        retry_on: Extra exception types that count as replica failures (e.g. a transport's
            own connection error).
        capabilities_timeout_s: Limit on fetching a Ray replica's capabilities at construction.
        probe_backoff_s: An out-of-rotation replica is sent one request (a probe) after this
            long; a success puts it back, a failure retries the request elsewhere.
        max_probe_backoff_s: Cap of the probe backoff, which doubles after each failed probe.

    Raises:
        ValueError: on an empty ``servers`` list or bad routing parameters.
        TypeError: when an entry is neither an AsyncServer nor a ServerActor handle.
    """

    def __init__(
        self,
        servers: Sequence[Any],
        *,
        sticky_capacity: int = 10000,
        imbalance_threshold: int | None = 8,
        request_timeout_s: float | None = None,
        max_retries: int | None = None,
        retry_on: tuple[type[BaseException], ...] = (),
        capabilities_timeout_s: float = 60.0,
        probe_backoff_s: float = 5.0,
        max_probe_backoff_s: float = 60.0,
    ) -> None:
        servers = list(servers)
        if not servers:
            raise ValueError("LLMServerClient needs at least one server (got an empty list)")
        if request_timeout_s is not None and request_timeout_s <= 0:
            raise ValueError(f"request_timeout_s must be > 0 or None, got {request_timeout_s}")
        if max_retries is not None and max_retries < 0:
            raise ValueError(f"max_retries must be >= 0 or None, got {max_retries}")
        self.servers = servers
        self._replicas = [_Replica(s, i, capabilities_timeout_s) for i, s in enumerate(servers)]
        self.policy = StickyLeastInFlightPolicy(
            len(servers), sticky_capacity=sticky_capacity, imbalance_threshold=imbalance_threshold,
            probe_backoff_s=probe_backoff_s, max_probe_backoff_s=max_probe_backoff_s,
        )
        self.request_timeout_s = request_timeout_s
        self.max_retries = len(servers) - 1 if max_retries is None else max_retries
        self.retry_on = tuple(retry_on)
        self.client_stats = ClientStats()
        self.capabilities = ServerCapabilities(**{
            f.name: all(getattr(r.capabilities, f.name) for r in self._replicas)
            for f in fields(ServerCapabilities)
        })
        self._background: set[asyncio.Task[Any]] = set()

    # ---- state ----------------------------------------------------------------------------

    @property
    def healthy_replicas(self) -> list[int]:
        """Indices of the replicas in rotation."""
        return self.policy.healthy_replicas

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
        snap["next_probe_in_s"] = [self.policy.next_probe_in(i) for i in range(len(self._replicas))]
        return snap

    def mark_healthy(self, index: int) -> None:
        """Put a replica back into rotation (after it was restarted or recovered)."""
        self.policy.mark_healthy(index)

    def forget_session(self, request_id: str) -> None:
        """Drop the sticky session of a finished trajectory, freeing its LRU slot early."""
        self.policy.forget(request_id)

    # ---- routed calls ---------------------------------------------------------------------

    async def generate(
        self,
        request_id: str,
        prompt_ids: list[int],
        sampling_params: Mapping[str, Any] | SamplingParams | None = None,
    ) -> TokenOutput:
        """Generate on one replica, chosen by the routing policy, failing over when it dies.

        Args:
            request_id: The trajectory id: the sticky-session key and what ``abort`` targets.
            prompt_ids: The full prompt as token ids.
            sampling_params: A mapping or :class:`SamplingParams` (validated here first, so a
                typo fails before any replica is touched).

        Returns:
            The replica's output; ``extra["replica"]`` names the replica index that served it.

        Raises:
            ValueError: bad sampling parameters or a request a replica rejected (not retried).
            NoHealthyReplicaError: every replica failed or is out of rotation.
        """
        sp = SamplingParams.from_mapping(sampling_params)
        prompt_ids = list(prompt_ids)
        return await self._routed(request_id, "generate", request_id, prompt_ids, sp,
                                 prompt_tokens=len(prompt_ids))

    async def _routed(self, request_id: str, method: str, *args: Any,
                      prompt_tokens: int | None = None) -> Any:
        tried: list[int] = []
        failures: list[str] = []
        while True:
            try:
                index = self.policy.choose(request_id, exclude=tried, prompt_tokens=prompt_tokens)
            except NoHealthyReplicaError as exc:
                self.client_stats.failed += 1
                detail = "; ".join(failures) or "none tried"
                raise NoHealthyReplicaError(f"{exc}. Failures for this request: {detail}") from None
            replica = self._replicas[index]
            self.policy.acquire(index)
            try:
                coro = replica.call(method, *args)
                if self.request_timeout_s is None:
                    result = await coro
                else:
                    result = await asyncio.wait_for(coro, self.request_timeout_s)
            except Exception as exc:
                if not (is_replica_failure(exc) or isinstance(exc, self.retry_on)):
                    self.client_stats.failed += 1
                    raise
                failure = self._on_replica_failure(replica, request_id, exc)
                tried.append(index)
                failures.append(failure)
                if len(tried) > self.max_retries:
                    self.client_stats.failed += 1
                    raise NoHealthyReplicaError(
                        f"request {request_id!r} failed on {len(tried)} replica(s) "
                        f"(max_retries={self.max_retries}): {'; '.join(failures)}"
                    ) from exc
                self.client_stats.retries += 1
                continue
            finally:
                self.policy.release(index)
            self.policy.record_success(index)
            self.client_stats.completed += 1
            if isinstance(result, TokenOutput):
                result = dataclasses.replace(result, extra={**result.extra, "replica": index})
            return result

    def _on_replica_failure(self, replica: _Replica, request_id: str, exc: BaseException,
                            *, probe: bool = True) -> str:
        timed_out = isinstance(exc, (asyncio.TimeoutError, TimeoutError)) and not _is_remote(exc)
        self.client_stats.replica_failures += 1
        if timed_out:
            self.client_stats.timeouts += 1
            # The hung replica may still be working on it; stop it so it does not finish later.
            self._spawn(self._quiet_abort(replica, request_id))
        self.policy.mark_unhealthy(replica.index, probe=probe)
        # asyncio.wait_for's TimeoutError has no message; a transport's own timeout (RemoteServer's
        # timeout_s) has one, and request_timeout_s may not even be set then.
        what = (f"timed out after {self.request_timeout_s}s" if timed_out and not str(exc)
                else f"{type(exc).__name__}: {exc}")
        logger.warning("replica %d taken out of rotation: %s (request %r will be retried)",
                       replica.index, what, request_id)
        return f"replica {replica.index} {what}"

    # ---- fan-out calls --------------------------------------------------------------------

    async def abort(self, request_id: str) -> None:
        """Abort ``request_id`` on the replica holding its session (all replicas if none does)."""
        index = self.policy.session_replica(request_id)
        targets = [index] if index is not None else self.healthy_replicas
        await asyncio.gather(*(self._quiet_abort(self._replicas[i], request_id) for i in targets))

    async def _quiet_abort(self, replica: _Replica, request_id: str) -> None:
        # An abort must not raise because the replica is already gone: there is nothing left
        # to stop there, and the caller's request is released by its own finally.
        try:
            coro = replica.call("abort", request_id)
            await (coro if self.request_timeout_s is None else asyncio.wait_for(coro, self.request_timeout_s))
        except Exception as exc:
            if not (is_replica_failure(exc) or isinstance(exc, self.retry_on)):
                raise
            logger.warning("abort(%r) on replica %d failed: %s", request_id, replica.index, exc)

    async def sleep(self) -> None:
        """Release accelerator memory on every healthy replica.

        Raises:
            CapabilityNotSupportedError: unless every replica declares ``sleep``.
        """
        self._require("sleep")
        await self._fan_out("sleep")

    async def wake_up(self) -> None:
        """Restore what :meth:`sleep` released on every healthy replica."""
        self._require("sleep")
        await self._fan_out("wake_up")

    async def update_weights(self, named_tensors: Iterable[tuple[str, Any]]) -> None:
        """Load new weights into every healthy replica.

        A replica that fails the update is taken out of rotation, and not probed back, so it
        never serves stale weights; :meth:`mark_healthy` returns it once it has the weights.

        Raises:
            CapabilityNotSupportedError: unless every replica declares ``weight_update``.
        """
        self._require("weight_update")
        # Materialise once: a generator would be exhausted by the first replica; a state dict
        # gives (name, tensor) pairs, not just its keys.
        payload: Any = list(named_tensors.items()) if isinstance(named_tensors, Mapping) else list(named_tensors)
        if any(r.is_actor for r in self._replicas):
            import ray

            payload = ray.put(payload)  # one copy in the object store instead of one per actor
        await self._fan_out("update_weights", payload)

    async def close(self) -> None:
        """Wait for background aborts. Replicas are not closed: the client does not own them."""
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)

    def _require(self, flag: str) -> None:
        if not getattr(self.capabilities, flag):
            lacking = [r.index for r in self._replicas if not getattr(r.capabilities, flag)]
            raise CapabilityNotSupportedError(
                f"replicas {lacking} do not declare capabilities.{flag}; the client supports only "
                "what every replica supports"
            )

    async def _fan_out(self, method: str, *args: Any) -> None:
        targets = [self._replicas[i] for i in self.healthy_replicas]
        if not targets:
            raise NoHealthyReplicaError(f"{method}: no replica in rotation")
        results = await asyncio.gather(*(r.call(method, *args) for r in targets), return_exceptions=True)
        errors = []
        for replica, res in zip(targets, results, strict=True):
            if isinstance(res, BaseException):
                if is_replica_failure(res) or isinstance(res, self.retry_on):
                    # No probing back: a replica that missed a weight update or a sleep/wake
                    # would answer a probe with stale weights; mark_healthy once it is fixed.
                    self._on_replica_failure(replica, f"<{method}>", res, probe=False)
                errors.append((replica.index, res))
        if errors:
            index, first = errors[0]
            raise RuntimeError(
                f"{method} failed on replicas {[i for i, _ in errors]} (dead ones were taken out "
                f"of rotation); first error on replica {index}: {type(first).__name__}: {first}"
            ) from first

    def _spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)


def _is_remote(exc: BaseException) -> bool:
    # A TimeoutError raised inside a Ray actor arrives wrapped; only our own wait_for timeout
    # means "this replica hung".
    return type(exc).__module__.startswith("ray")
