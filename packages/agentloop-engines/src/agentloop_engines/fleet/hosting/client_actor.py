"""One shared :class:`~agentloop_engines.fleet.client.LLMServerClient` as a Ray actor.

:func:`client_actor` hosts the client as an async actor and returns a :class:`RemoteClient`,
a small picklable proxy. Every AgentLoopWorker (often Ray actors themselves) gets a copy of the
proxy, so all their requests go through the same routing state: least in-flight counts and
sticky sessions are global, not per worker. :func:`local_client` is the in-process alternative
for a single sending process.

For asynchronous RL, ``client_actor(..., partial_rollout=True)`` hosts a
:class:`~agentloop_core.partial_rollout.PartialRolloutServer` in front of the routing client,
inside the actor: every worker's ``generate`` then passes one gate, so a weight update pauses
all of them and the ledger of per-token policy versions is complete. The proxy is the trainer's
:class:`~agentloop_core.partial_rollout.RolloutControl` (``pause``, ``update_weights``,
``unpause``, ``track``, ``pop_ledger_many``, ...). A wrapper pickled into each worker instead
would give every worker its own gate and ledger, which is why the wrapper lives here.

The control calls run in their own concurrency group (:data:`CONTROL_CONCURRENCY` slots) and
do their work on the generate calls' event loop, so a pause or an unpause is never queued behind
``max_concurrency`` generate calls waiting at the closed gate. While the gate is closed (one
weight push: every bucket) a worker's ``generate`` waits in the actor; that wait counts against
the rollout's own limits (the manager's ``ray_timeout_s`` per batch, the loops'
``sample_timeout_s`` per sample), so a push must stay well under them.

Ray is imported lazily; ``import agentloop_engines`` never imports it.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from agentloop_core.partial_rollout import PartialRolloutServer, PartialRolloutState
from agentloop_core.protocol import SamplingParams, ServerCapabilities, TokenOutput
from agentloop_core.server_wrapper import BusyTimeServer, ServerWrapper
from agentloop_engines.fleet.hosting.cluster import import_ray

__all__ = ["CONTROL_CONCURRENCY", "ClientActor", "RemoteClient", "client_actor", "local_client"]

_PURPOSE = "The shared client actor"

_CONTROL = "control"
CONTROL_CONCURRENCY = 16
"""Slots of the client actor's ``control`` concurrency group (weight pushes, pause/unpause,
ledger calls), apart from the ``max_concurrency`` slots of generate calls."""


@functools.cache
def _client_actor_class() -> Any:
    return import_ray(_PURPOSE).remote(concurrency_groups={_CONTROL: CONTROL_CONCURRENCY})(ClientActor)


def local_client(handles: Sequence[Any], **client_kwargs: Any) -> Any:
    """An in-process :class:`~agentloop_engines.fleet.client.LLMServerClient` over replica handles.

    Use it when a single process sends all requests; use :func:`client_actor` when several
    workers must share one routing view.
    """
    from agentloop_engines.fleet.client import LLMServerClient

    return LLMServerClient(list(handles), **client_kwargs)


class ClientActor(ServerWrapper):
    """Body of the Ray async actor hosting one shared ``LLMServerClient``.

    Args:
        handles: The engine replicas' actor handles.
        client_kwargs: Passed to ``LLMServerClient``.
        partial_rollout: None: ``self.server`` is the client behind a ``BusyTimeServer`` (its
            busy time, for a step's engine idle fraction). A mapping: ``self.server`` is a
            ``PartialRolloutServer(client, **partial_rollout)`` (e.g. ``{"interrupt": False}``),
            driven through the control methods.
    """

    def __init__(self, handles: Sequence[Any], client_kwargs: Mapping[str, Any],
                 partial_rollout: Mapping[str, Any] | None = None) -> None:
        from agentloop_engines.fleet.client import LLMServerClient

        self._client = LLMServerClient(list(handles), **dict(client_kwargs))
        self._rollout = None if partial_rollout is None else PartialRolloutServer(self._client,
                                                                                  **dict(partial_rollout))
        super().__init__(self._rollout if self._rollout is not None else BusyTimeServer(self._client))
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def client(self) -> Any:
        """The hosted ``LLMServerClient``."""
        return self._client

    def _partial_rollout(self) -> PartialRolloutServer:
        if self._rollout is None:
            raise RuntimeError("this client actor hosts no PartialRolloutServer; start it with "
                               "client_actor(..., partial_rollout=True) to pause it for weight updates")
        return self._rollout

    async def get_capabilities(self) -> ServerCapabilities:
        # The first call (client_actor and RemoteClient.from_name wait on it) runs in the
        # default concurrency group: its event loop is the one every generate runs on.
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
        return self.client.capabilities

    async def get_stats(self) -> dict[str, Any]:
        return self.client.stats

    async def mark_healthy(self, index: int) -> None:
        self.client.mark_healthy(index)

    # A coroutine here, unlike ServerWrapper's: callers send it with .remote(), and as an async
    # method it runs on the default group's loop, which owns the client's routing state.
    async def forget_session(self, request_id: str) -> None:  # pyright: ignore[reportIncompatibleMethodOverride]
        self.client.forget_session(request_id)

    # -- partial rollout (the RolloutControl calls, in the control concurrency group) ----------
    # Ray runs each concurrency group of an async actor on its own event loop, in its own
    # thread. The wrapper's gate and the routing client are asyncio state of the default
    # group's loop (where every generate runs), so a control call only hops there: its work
    # then needs no generate slot, and nothing touches that state from another thread.

    async def _on_generate_loop(self, fn: Callable[..., Any], *args: Any) -> Any:
        if self._loop is None:  # no default-group call yet: make one, which records the loop
            ray = import_ray(_PURPOSE)
            await ray.get_runtime_context().current_actor.get_capabilities.remote()
        assert self._loop is not None

        async def call() -> Any:
            out = fn(*args)
            return await out if inspect.isawaitable(out) else out

        if asyncio.get_running_loop() is self._loop:
            return await call()
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(call(), self._loop))

    async def hosts_partial_rollout(self) -> bool:
        return self._rollout is not None

    async def busy_seconds(self) -> float:
        return await self._on_generate_loop(self.server.busy_seconds)

    async def set_policy_version(self, policy_version: int) -> None:
        rollout = self._partial_rollout()
        await self._on_generate_loop(setattr, rollout, "policy_version", int(policy_version))

    async def pause(self) -> None:
        await self._on_generate_loop(self._partial_rollout().pause)

    async def update_weights(self, named_tensors: Iterable[tuple[str, Any]]) -> None:
        await self._on_generate_loop(self.server.update_weights, named_tensors)

    async def unpause(self, policy_version: int | None = None) -> None:
        await self._on_generate_loop(self._partial_rollout().unpause, policy_version)

    async def track(self, request_ids: list[str]) -> None:
        await self._on_generate_loop(self._partial_rollout().track, request_ids)

    async def pop_ledger_many(self, request_ids: list[str]) -> list[tuple[list[int], list[int]]]:
        return await self._on_generate_loop(self._partial_rollout().pop_ledger_many, request_ids)

    async def rollout_state(self) -> PartialRolloutState:
        return await self._on_generate_loop(self._partial_rollout().snapshot)


class RemoteClient:
    """Picklable proxy to a :class:`ClientActor`; an ``AsyncServer`` for agent loops and, for an
    actor started with ``partial_rollout=True``, the trainer's
    :class:`~agentloop_core.partial_rollout.RolloutControl`.

    Copies of one proxy (in any process of the Ray cluster) share the actor's routing state
    (and its weight-update gate and ledger).

    Args:
        actor: Handle of a ClientActor.
        capabilities: The client's capabilities (fetched once by :func:`client_actor`).
        partial_rollout: Whether the actor hosts a ``PartialRolloutServer``.
    """

    def __init__(self, actor: Any, capabilities: ServerCapabilities, partial_rollout: bool = False) -> None:
        self.actor = actor
        self.capabilities = capabilities
        self.partial_rollout = partial_rollout

    def _control(self, method: str) -> Any:
        return getattr(self.actor, method).options(concurrency_group=_CONTROL)

    @classmethod
    def from_name(cls, name: str, *, namespace: str | None = None, timeout_s: float = 60.0) -> RemoteClient:
        """Connect to a client actor started with ``client_actor(..., name=name)``."""
        ray = import_ray(_PURPOSE)
        actor = ray.get_actor(name, namespace=namespace)
        caps, partial = ray.get([actor.get_capabilities.remote(), actor.hosts_partial_rollout.remote()],
                                timeout=timeout_s)
        return cls(actor, caps, partial_rollout=partial)

    async def generate(self, request_id: str, prompt_ids: list[int],
                       sampling_params: Mapping[str, Any] | SamplingParams | None = None,
                       **multi_modal: Any) -> TokenOutput:
        """See :meth:`LLMServerClient.generate` (``multi_modal_data`` travels pickled with the call)."""
        # Validate here too: the error then points at the caller's line, not a Ray traceback.
        sp = SamplingParams.from_mapping(sampling_params)
        return await self.actor.generate.remote(request_id, list(prompt_ids), sp, **multi_modal)

    async def abort(self, request_id: str) -> None:
        """See :meth:`LLMServerClient.abort`."""
        await self.actor.abort.remote(request_id)

    async def sleep(self) -> None:
        """See :meth:`LLMServerClient.sleep`."""
        await self.actor.sleep.remote()

    async def wake_up(self) -> None:
        """See :meth:`LLMServerClient.wake_up`."""
        await self.actor.wake_up.remote()

    async def update_weights(self, named_tensors: Iterable[tuple[str, Any]]) -> None:
        """See :meth:`LLMServerClient.update_weights` (with partial rollout: a bucket of the
        push between :meth:`pause` and :meth:`unpause`, or a whole update of its own outside)."""
        # The control group: generate calls held at a closed gate may fill every other slot.
        await self._control("update_weights").remote(list(named_tensors))

    def forget_session(self, request_id: str) -> None:
        """See :meth:`LLMServerClient.forget_session`: sent to the actor without waiting."""
        self.actor.forget_session.remote(request_id)

    async def get_stats(self) -> dict[str, Any]:
        """The shared client's ``stats`` snapshot (routing counters, in-flight, health)."""
        return await self.actor.get_stats.remote()

    async def mark_healthy(self, index: int) -> None:
        """Put a replica back into the shared client's rotation."""
        await self.actor.mark_healthy.remote(index)

    async def busy_seconds(self) -> float:
        """Wall seconds so far with at least one ``generate`` in flight through the actor, from
        any worker (a control call: never queued behind generates)."""
        return await self._control("busy_seconds").remote()

    # -- RolloutControl (actors started with partial_rollout=True) ----------------------------

    async def set_policy_version(self, policy_version: int) -> None:
        """Declare the version of the weights the engines hold now (no update happens)."""
        await self._control("set_policy_version").remote(int(policy_version))

    async def pause(self) -> None:
        """Close the actor's gate for every worker and return once no engine call is in flight
        (see ``PartialRolloutServer.pause``)."""
        await self._control("pause").remote()

    async def unpause(self, policy_version: int | None = None) -> None:
        """Open the gate on the pushed weights (see ``PartialRolloutServer.unpause``)."""
        await self._control("unpause").remote(policy_version)

    async def track(self, request_ids: Iterable[str]) -> None:
        """Record these ids' tokens and versions in the actor's ledger; call before they start."""
        await self._control("track").remote(list(request_ids))

    async def pop_ledger_many(self, request_ids: Iterable[str]) -> list[tuple[list[int], list[int]]]:
        """``(token_ids, policy_versions)`` of each tracked id, in order, and stop tracking them."""
        return await self._control("pop_ledger_many").remote(list(request_ids))

    async def rollout_state(self) -> PartialRolloutState:
        """The hosted wrapper's version, gate, busy seconds, ledger size and stats."""
        return await self._control("rollout_state").remote()


def client_actor(
    handles: Sequence[Any],
    *,
    name: str | None = None,
    namespace: str | None = None,
    num_cpus: float = 0.1,
    max_concurrency: int = 10000,
    ready_timeout_s: float = 120.0,
    node_id: str | None = None,
    partial_rollout: bool = False,
    interrupt: bool = True,
    **client_kwargs: Any,
) -> RemoteClient:
    """Host an ``LLMServerClient`` over ``handles`` as a Ray actor and return its proxy.

    Args:
        handles: ReplicaActor handles (e.g. from :func:`start_replicas`).
        name: Optional actor name, so other drivers can :meth:`RemoteClient.from_name` it.
        namespace: Ray namespace of the named actor.
        num_cpus: CPUs reserved by the client actor (it only routes).
        max_concurrency: Requests it routes concurrently; bound it above the total number of
            trajectories in flight, or requests queue inside Ray, invisible to the balancer.
            Control calls (weight pushes, pause) have :data:`CONTROL_CONCURRENCY` slots of their own.
        ready_timeout_s: How long to wait for the actor to start.
        node_id: Pin the actor to this node (hard affinity), e.g. the driver's own
            (``ray.get_runtime_context().get_node_id()``): every request goes through it, so it
            should live where losing it loses the run anyway, not on a worker node.
        partial_rollout: Host a ``PartialRolloutServer`` in front of the client (asynchronous
            RL): the returned proxy then pauses every worker's generations around weight pushes.
        interrupt: With ``partial_rollout``: True: a pause aborts in-flight generations and they
            resume on the new weights; False: it waits for them to finish (one-step-off).
        **client_kwargs: Passed to ``LLMServerClient`` (``imbalance_threshold``,
            ``request_timeout_s``, ...).

    Returns:
        A picklable :class:`RemoteClient`.
    """
    ray = import_ray(_PURPOSE)
    options: dict[str, Any] = {}
    if node_id is not None:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node_id, soft=False)
    actor = _client_actor_class().options(
        name=name, namespace=namespace, num_cpus=num_cpus, max_concurrency=max_concurrency, **options
    ).remote(list(handles), client_kwargs, {"interrupt": interrupt} if partial_rollout else None)
    try:
        caps = ray.get(actor.get_capabilities.remote(), timeout=ready_timeout_s)
    except ray.exceptions.GetTimeoutError as exc:
        ray.kill(actor)
        raise TimeoutError(
            f"client actor not ready after {ready_timeout_s}s (num_cpus={num_cpus}); check "
            "ray.available_resources()"
        ) from exc
    return RemoteClient(actor, caps, partial_rollout=partial_rollout)

