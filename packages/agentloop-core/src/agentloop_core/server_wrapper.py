"""Objects that stand in front of an engine and forward to it: a seeding layer, a turn pacer, a
recorder, the Ray actor bodies that host an engine or a client. Each overrides only what it
changes; the rest of the :class:`~agentloop_core.protocol.AsyncServer` API is forwarded here,
once."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from agentloop_core.protocol import SamplingParams, ServerCapabilities, TokenOutput

__all__ = ["ServerWrapper", "TransparentServerWrapper"]


class ServerWrapper:
    """Forwards the ``AsyncServer`` API to ``self.server``.

    Args:
        server: The engine, or a client in front of several.
    """

    def __init__(self, server: Any) -> None:
        self.server = server

    @property
    def capabilities(self) -> ServerCapabilities:
        """The wrapped server's capabilities."""
        return self.server.capabilities

    async def generate(self, request_id: str, prompt_ids: list[int],
                       sampling_params: Mapping[str, Any] | SamplingParams | None = None) -> TokenOutput:
        """See ``AsyncServer.generate``."""
        return await self.server.generate(request_id, prompt_ids, sampling_params)

    async def abort(self, request_id: str) -> None:
        """See ``AsyncServer.abort``."""
        await self.server.abort(request_id)

    async def sleep(self) -> None:
        """See ``AsyncServer.sleep``."""
        await self.server.sleep()

    async def wake_up(self) -> None:
        """See ``AsyncServer.wake_up``."""
        await self.server.wake_up()

    async def update_weights(self, named_tensors: Iterable[tuple[str, Any]]) -> None:
        """See ``AsyncServer.update_weights``."""
        await self.server.update_weights(named_tensors)


class TransparentServerWrapper(ServerWrapper):
    """A :class:`ServerWrapper` through which every other attribute of the engine is read too
    (``chat_completion``, ``vocab_size``, ``tokenizer``...), so loops that read them work
    unchanged behind it. Not for Ray actor bodies (their methods must be declared)."""

    def __getattr__(self, name: str) -> Any:
        # Only reached for attributes not defined on the wrapper.
        if name == "server":  # during unpickling, before __dict__ is filled
            raise AttributeError(name)
        return getattr(self.server, name)
