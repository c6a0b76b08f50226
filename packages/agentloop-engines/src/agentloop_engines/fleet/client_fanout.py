"""The calls :class:`~agentloop_engines.fleet.client.LLMServerClient` makes on every replica at once:
weight pushes (with the stale-replica bookkeeping of :mod:`agentloop_engines.fleet.weight_ledger`),
``sleep``/``wake_up``, ``abort``; and how a replica that failed is taken out of rotation.

Kept apart from the routing of single requests (:mod:`agentloop_engines.fleet.client`), which reads
on its own: :class:`ReplicaFanOut` is the client's base class and holds no state of its own;
the client's constructor sets what it declares.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable, Mapping
from typing import Any

from agentloop_core.protocol import CapabilityNotSupportedError, ServerCapabilities
from agentloop_engines.fleet.client_stats import ClientStats
from agentloop_engines.fleet.http_client import ReplicaBusyError
from agentloop_engines.fleet.replica_calls import (
    MIN_BUSY_WAIT_S,
    Replica,
    is_miss,
    is_own_timeout,
    is_replica_failure,
)
from agentloop_engines.fleet.routing import NoHealthyReplicaError, StickyLeastInFlightPolicy
from agentloop_engines.fleet.weight_ledger import WeightLedger

# The client's logger: these lines were always the client's, and log settings name it.
logger = logging.getLogger("agentloop_engines.fleet.client")

__all__ = ["ReplicaFanOut"]


class ReplicaFanOut:
    """Fan-out calls and replica failure handling of :class:`~agentloop_engines.fleet.client.LLMServerClient`."""

    _handles: list[Replica]
    policy: StickyLeastInFlightPolicy
    weights: WeightLedger
    client_stats: ClientStats
    capabilities: ServerCapabilities
    request_timeout_s: float | None
    retry_on: tuple[type[BaseException], ...]
    busy_wait_s: float
    offline_push_timeout_s: float
    _instances: list[str | None]
    _background: set[asyncio.Task[Any]]

    @property
    def healthy_replicas(self) -> list[int]:
        """Indices of the replicas in rotation."""
        return self.policy.healthy_replicas

    def _on_replica_failure(self, replica: Replica, request_id: str, exc: BaseException,
                            *, was_probe: bool = False, probe: bool = True) -> str:
        self.client_stats.replica_failures += 1
        # Only the first failure of a replica (or a failed probe) takes it out and sets its
        # backoff: the other requests in flight there when it died fail too, and each must
        # not double the backoff again.
        if self.policy.healthy[replica.index] or was_probe or not probe:
            self.policy.mark_unhealthy(replica.index, probe=probe)
        what = (f"timed out after {self.request_timeout_s}s" if is_own_timeout(exc) and not str(exc)
                else f"{type(exc).__name__}: {exc}")
        logger.warning("replica %d taken out of rotation: %s (request %r will be retried)",
                       replica.index, what, request_id)
        return f"replica {replica.index} {what}"

    # ---- fan-out calls --------------------------------------------------------------------

    async def abort(self, request_id: str) -> None:
        """Abort ``request_id`` on the replica holding its session (all replicas if none does)."""
        index = self.policy.session_replica(request_id)
        targets = [index] if index is not None else self.healthy_replicas
        await asyncio.gather(*(self._quiet_abort(self._handles[i], request_id) for i in targets))

    async def _quiet_abort(self, replica: Replica, request_id: str) -> None:
        # An abort must not raise because the replica is already gone: there is nothing left
        # to stop there, and the caller's request is released by its own finally.
        try:
            coro = replica.call("abort", request_id)
            await (coro if self.request_timeout_s is None else asyncio.wait_for(coro, self.request_timeout_s))
        except Exception as exc:
            if not (is_replica_failure(exc) or isinstance(exc, (ReplicaBusyError, *self.retry_on))):
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
        """Load new weights (one bucket of a push) into every replica.

        Replicas out of rotation get them too (each call bounded by ``offline_push_timeout_s``):
        one that was down and is back must not keep old weights. A replica that misses the
        update (fails it, is unreachable, or stays at its in-flight limit past ``busy_wait_s``)
        while another one gets it is *stale*: out of rotation and never probed until a later
        update brings every weight it missed (the next full push), or :meth:`mark_healthy`.
        So no request is served on old weights, whatever policy version a caller labels it.

        Raises:
            CapabilityNotSupportedError: unless every replica declares ``weight_update``.
            RuntimeError: a replica in rotation failed the update (it is stale now, out of
                rotation; an error every replica gave, e.g. an unknown weight name, changes
                nothing).
        """
        self._require("weight_update")
        # Materialise once: a generator would be exhausted by the first replica; a state dict
        # gives (name, tensor) pairs, not just its keys.
        payload: Any = list(named_tensors.items()) if isinstance(named_tensors, Mapping) else list(named_tensors)
        names = [str(name) for name, _ in payload]
        if any(r.is_actor for r in self._handles):
            import ray

            payload = ray.put(payload)  # one copy in the object store instead of one per actor
        in_rotation = set(self.healthy_replicas)
        results = await asyncio.gather(*(self._push(r, payload, bounded=r.index not in in_rotation)
                                         for r in self._handles), return_exceptions=True)
        errors = {i: res for i, res in enumerate(results) if isinstance(res, BaseException)}
        got = [i for i in range(len(self._handles)) if i not in errors]
        for i in got:
            # Restarted since the last push: it now holds the checkpoint plus this bucket only.
            self._restarted(i, getattr(self._handles[i].target, "engine_instance", None))
        # A push every replica refused for its content (a bad name) left them all as they were;
        # one that some got, or that failed only on reachability, leaves the others behind.
        missed = [i for i, exc in errors.items() if got or is_miss(exc, self.retry_on)]
        stale, current = self.weights.record(names, got, missed)
        self.client_stats.missed_pushes += len(missed)
        for i in stale:
            if i in in_rotation:
                self.client_stats.replica_failures += 1
            self.policy.set_stale(i, True)
        for i in current:
            self.policy.set_stale(i, False)  # an out-of-rotation replica is probed at once
            logger.warning("replica %d holds the latest weights again; it is probed back", i)
        for i, exc in errors.items():
            if i in missed:
                logger.warning("replica %d missed a weight update (%s: %s); it stays out of rotation until an "
                               "update of every weight it missed reaches it", i, type(exc).__name__, exc)
        failed_in_rotation = sorted(i for i in errors if i in in_rotation)
        if failed_in_rotation:
            first = errors[failed_in_rotation[0]]
            raise RuntimeError(
                f"update_weights failed on replicas {failed_in_rotation} (those that missed it are out of "
                f"rotation until a later push reaches them); first error on replica {failed_in_rotation[0]}: "
                f"{type(first).__name__}: {first}") from first

    def _restarted(self, index: int, instance: Any) -> bool:
        """Note the engine instance replica ``index`` answered from; True when it changed after
        weights were pushed (the replica is stale from now on)."""
        if not isinstance(instance, str):
            return False  # an engine that does not say (in-process, Ray): no restart to see
        known, self._instances[index] = self._instances[index], instance
        if known is None or known == instance or not self.weights.lost_all(index):
            return False
        logger.warning("replica %d restarted (engine instance %s -> %s) and lost the pushed weights; it stays out "
                       "of rotation until a push of every weight reaches it", index, known, instance)
        self.client_stats.replica_failures += 1
        self.policy.set_stale(index, True)
        return True

    async def _push(self, replica: Replica, payload: Any, *, bounded: bool) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.busy_wait_s
        while True:
            coro = replica.call("update_weights", payload)
            try:
                await (asyncio.wait_for(coro, self.offline_push_timeout_s) if bounded else coro)
                return
            except ReplicaBusyError as exc:
                # At its in-flight limit: wait the slot out rather than miss the push.
                self.client_stats.busy += 1
                wait = max(MIN_BUSY_WAIT_S, exc.retry_after_s)
                if loop.time() + wait > deadline:
                    raise
                await asyncio.sleep(wait)

    async def close(self) -> None:
        """Wait for background aborts. Replicas are not closed: the client does not own them."""
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)

    def _require(self, flag: str) -> None:
        if not getattr(self.capabilities, flag):
            lacking = [r.index for r in self._handles if not getattr(r.capabilities, flag)]
            raise CapabilityNotSupportedError(
                f"replicas {lacking} do not declare capabilities.{flag}; the client supports only "
                "what every replica supports"
            )

    async def _fan_out(self, method: str, *args: Any) -> None:
        targets = [self._handles[i] for i in self.healthy_replicas]
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
