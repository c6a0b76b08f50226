"""One shared :class:`~agentloop_engines.client.LLMServerClient` as a Ray actor.

:func:`client_actor` hosts the client as an async actor and returns a :class:`RemoteClient`,
a small picklable proxy. Every AgentLoopWorker (often Ray actors themselves) gets a copy of the
proxy, so all their requests go through the same routing state: least in-flight counts and
sticky sessions are global, not per worker. :func:`local_client` is the in-process alternative
for a single sending process.

Ray is imported lazily; ``import agentloop_engines`` never imports it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from agentloop_core.protocol import SamplingParams, ServerCapabilities, TokenOutput
from agentloop_core.server_wrapper import ServerWrapper
from agentloop_engines.hosting.cluster import _remote_class, import_ray

__all__ = ["ClientActor", "RemoteClient", "client_actor", "local_client"]

_PURPOSE = "The shared client actor"


def local_client(handles: Sequence[Any], **client_kwargs: Any) -> Any:
    """An in-process :class:`~agentloop_engines.client.LLMServerClient` over replica handles.

    Use it when a single process sends all requests; use :func:`client_actor` when several
    workers must share one routing view.
    """
    from agentloop_engines.client import LLMServerClient

    return LLMServerClient(list(handles), **client_kwargs)


class ClientActor(ServerWrapper):
    """Body of the Ray async actor hosting one shared ``LLMServerClient`` (``self.server``)."""

    def __init__(self, handles: Sequence[Any], client_kwargs: Mapping[str, Any]) -> None:
        from agentloop_engines.client import LLMServerClient

        super().__init__(LLMServerClient(list(handles), **dict(client_kwargs)))

    @property
    def client(self) -> Any:
        """The hosted ``LLMServerClient``."""
        return self.server

    async def get_capabilities(self) -> ServerCapabilities:
        return self.client.capabilities

    async def chat_completion(self, request: Mapping[str, Any]) -> dict[str, Any]:
        return await self.client.chat_completion(request)

    async def get_stats(self) -> dict[str, Any]:
        return self.client.stats

    async def mark_healthy(self, index: int) -> None:
        self.client.mark_healthy(index)

    async def forget_session(self, request_id: str) -> None:
        self.client.forget_session(request_id)


class RemoteClient:
    """Picklable proxy to a :class:`ClientActor`; an ``AsyncServer`` for agent loops.

    Copies of one proxy (in any process of the Ray cluster) share the actor's routing state.

    Args:
        actor: Handle of a ClientActor.
        capabilities: The client's capabilities (fetched once by :func:`client_actor`).
    """

    def __init__(self, actor: Any, capabilities: ServerCapabilities) -> None:
        self.actor = actor
        self.capabilities = capabilities

    @classmethod
    def from_name(cls, name: str, *, namespace: str | None = None, timeout_s: float = 60.0) -> RemoteClient:
        """Connect to a client actor started with ``client_actor(..., name=name)``."""
        ray = import_ray(_PURPOSE)
        actor = ray.get_actor(name, namespace=namespace)
        return cls(actor, ray.get(actor.get_capabilities.remote(), timeout=timeout_s))

    async def generate(self, request_id: str, prompt_ids: list[int],
                       sampling_params: Mapping[str, Any] | SamplingParams | None = None) -> TokenOutput:
        """See :meth:`LLMServerClient.generate`."""
        # Validate here too: the error then points at the caller's line, not a Ray traceback.
        sp = SamplingParams.from_mapping(sampling_params)
        return await self.actor.generate.remote(request_id, list(prompt_ids), sp)

    async def chat_completion(self, request: Mapping[str, Any]) -> dict[str, Any]:
        """See :meth:`LLMServerClient.chat_completion`."""
        return await self.actor.chat_completion.remote(dict(request))

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
        """See :meth:`LLMServerClient.update_weights`."""
        await self.actor.update_weights.remote(list(named_tensors))

    async def get_stats(self) -> dict[str, Any]:
        """The shared client's ``stats`` snapshot (routing counters, in-flight, health)."""
        return await self.actor.get_stats.remote()

    async def mark_healthy(self, index: int) -> None:
        """Put a replica back into the shared client's rotation."""
        await self.actor.mark_healthy.remote(index)


def client_actor(
    handles: Sequence[Any],
    *,
    name: str | None = None,
    namespace: str | None = None,
    num_cpus: float = 0.1,
    max_concurrency: int = 10000,
    ready_timeout_s: float = 120.0,
    node_id: str | None = None,
    **client_kwargs: Any,
) -> RemoteClient:
    """Host an ``LLMServerClient`` over ``handles`` as a Ray actor and return its proxy.

    Args:
        handles: ServerActor handles (e.g. from :func:`start_replicas`).
        name: Optional actor name, so other drivers can :meth:`RemoteClient.from_name` it.
        namespace: Ray namespace of the named actor.
        num_cpus: CPUs reserved by the client actor (it only routes).
        max_concurrency: Requests it routes concurrently; bound it above the total number of
            trajectories in flight, or requests queue inside Ray, invisible to the balancer.
        ready_timeout_s: How long to wait for the actor to start.
        node_id: Pin the actor to this node (hard affinity), e.g. the driver's own
            (``ray.get_runtime_context().get_node_id()``): every request goes through it, so it
            should live where losing it loses the run anyway, not on a worker node.
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
    actor = _remote_class(ClientActor).options(
        name=name, namespace=namespace, num_cpus=num_cpus, max_concurrency=max_concurrency, **options
    ).remote(list(handles), client_kwargs)
    try:
        caps = ray.get(actor.get_capabilities.remote(), timeout=ready_timeout_s)
    except ray.exceptions.GetTimeoutError as exc:
        ray.kill(actor)
        raise TimeoutError(
            f"client actor not ready after {ready_timeout_s}s (num_cpus={num_cpus}); check "
            "ray.available_resources()"
        ) from exc
    return RemoteClient(actor, caps)

