"""How :class:`~agentloop_engines.fleet.client.LLMServerClient` calls one replica and classifies what
goes wrong: a failure of the replica (fail over), backpressure, a timeout, or the request's own
error. Kept apart from the client so that its routing logic reads on its own.
"""

from __future__ import annotations

import asyncio
import sys
from dataclasses import dataclass, field
from typing import Any

from agentloop_core.protocol import ServerCapabilities, TokenOutput
from agentloop_engines.fleet.http_client import ReplicaBusyError

__all__ = ["MIN_BUSY_WAIT_S", "Attempts", "Replica", "ReplicaCall", "is_miss", "is_own_timeout", "is_replica_failure"]

_RAY_FAILURE_NAMES = ("RayActorError", "WorkerCrashedError", "NodeDiedError", "OwnerDiedError")


def _ray_failure_types() -> tuple[type[BaseException], ...]:
    # Only look at ray if something already imported it: a replica can only be a Ray actor
    # then, and `import agentloop_engines.fleet.client` must not pull ray in.
    ray = sys.modules.get("ray")
    if ray is None:
        return ()
    exc_mod = getattr(ray, "exceptions", None)
    return tuple(t for name in _RAY_FAILURE_NAMES if (t := getattr(exc_mod, name, None)) is not None)


def is_replica_failure(exc: BaseException) -> bool:
    """Whether ``exc`` means the replica (not the request) is broken, so another may serve it.

    ValueError is never a replica failure: a request that fails validation fails everywhere;
    nor is ``ReplicaBusyError`` (a 503 from the in-flight limit: backpressure). Connection
    errors, timeouts and dead Ray actors / workers / nodes are; so is an ``EngineHTTPClient``
    replica that is unreachable or answers 502/503 (without ``Retry-After``)/504: it raises
    ``ReplicaUnavailableError``, a ``ConnectionError``.
    """
    if isinstance(exc, (ValueError, ReplicaBusyError)):
        return False
    if isinstance(exc, (ConnectionError, TimeoutError, asyncio.TimeoutError)):
        return True
    ray_types = _ray_failure_types()
    return bool(ray_types) and isinstance(exc, ray_types)


def _is_actor_handle(obj: Any) -> bool:
    ray = sys.modules.get("ray")
    return ray is not None and isinstance(obj, ray.actor.ActorHandle)


class Replica:
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
                    "agentloop_engines.fleet.hosting.ReplicaActor (start_replicas does)"
                ) from exc
        else:
            if not callable(getattr(target, "generate", None)):
                raise TypeError(
                    f"replica {index} ({type(target).__name__}) has no generate(); pass AsyncServer "
                    "objects or Ray actor handles of ReplicaActor"
                )
            caps = getattr(target, "capabilities", None)
        if not isinstance(caps, ServerCapabilities):
            raise TypeError(
                f"replica {index} declares capabilities={caps!r}; an AsyncServer must set a "
                "ServerCapabilities instance"
            )
        self.capabilities = caps

    def forget(self, request_id: str) -> None:
        """``forget_session`` on the replica: a Ray actor is sent it without waiting (a lost
        hint costs memory until the replica's own bound, never a request)."""
        if self.is_actor:
            self.target.forget_session.remote(request_id)
        else:
            self.target.forget_session(request_id)

    async def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        if self.is_actor:
            return await getattr(self.target, method).remote(*args, **kwargs)
        return await getattr(self.target, method)(*args, **kwargs)


class ReplicaCall:
    """What one attempt of a routed request does on the replica chosen for it: call ``method``.

    The client routes, times out, fails over and checks for a restarted engine around
    :meth:`run`; a subclass that opens a stream (:mod:`agentloop_engines.fleet.client_stream`)
    :attr:`holds` the replica's in-flight slot past it.
    """

    holds = False
    """Whether the result keeps using the replica after :meth:`run` returns (a stream): the
    client then leaves its in-flight slot held, and the result's owner releases it."""

    def __init__(self, method: str, args: tuple[Any, ...], kwargs: dict[str, Any] | None = None) -> None:
        self.method = method
        self.args = args
        self.kwargs = kwargs or {}

    async def run(self, replica: Replica) -> Any:
        """Make the call on ``replica``; what it returns is the attempt's result."""
        return await replica.call(self.method, *self.args, **self.kwargs)

    def instance(self, replica: Replica, result: Any) -> Any:
        """The engine instance (lifetime id) the result came from, or None when unknown."""
        return result.extra.get("engine_instance") if isinstance(result, TokenOutput) else None

    async def discard(self, result: Any) -> None:
        """Drop a result the client will not hand out (served by a restarted engine)."""


MIN_BUSY_WAIT_S = 0.05
"""Shortest wait after a 503 (a ``Retry-After: 0`` must not spin)."""


@dataclass
class Attempts:
    """What one request went through on its way to a replica."""

    request_id: str
    tried: list[int] = field(default_factory=list)
    """Replicas that failed it (or timed out)."""
    waited: list[int] = field(default_factory=list)
    """Replicas whose probe by another request it waited for, and that stayed out."""
    busy: dict[int, float] = field(default_factory=dict)
    """Replicas that refused it at their in-flight limit since its last wait -> ``Retry-After``."""
    failures: list[str] = field(default_factory=list)
    """One line per failed attempt, for the error."""
    suspects: list[tuple[int, int]] = field(default_factory=list)
    """``(replica, suspicion token)`` of each timeout on a replica that completed nothing meanwhile."""
    only_timeouts: bool = True
    """Every failure was a timeout of a replica in rotation (so: the request is slow)."""

    def excluded(self) -> list[int]:
        """Replicas not to choose for its next attempt."""
        return [*self.tried, *self.waited, *self.busy]


def is_own_timeout(exc: BaseException) -> bool:
    """Whether ``exc`` is the client's own wait running out (or a transport's read timeout)."""
    # Our wait_for or a transport's read timeout (EngineHTTPClient's timeout_s); a TimeoutError
    # raised inside a Ray actor is that actor's business: an ordinary failure.
    return isinstance(exc, TimeoutError) and not _is_remote(exc)


def is_miss(exc: BaseException, retry_on: tuple[type[BaseException], ...]) -> bool:
    """Whether a replica that raised ``exc`` on a weight push missed it for reasons of its own
    (down, hung, busy), not because the push's content was refused."""
    return is_replica_failure(exc) or isinstance(exc, (ReplicaBusyError, *retry_on))


def _is_remote(exc: BaseException) -> bool:
    # A TimeoutError raised inside a Ray actor arrives wrapped; only our own wait_for timeout
    # means "this replica hung".
    return type(exc).__module__.startswith("ray")
