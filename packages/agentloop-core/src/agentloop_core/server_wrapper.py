"""Objects that stand in front of an engine and forward to it: a seeding layer, a turn pacer, a
recorder, the Ray actor bodies that host an engine or a client. Each overrides only what it
changes; the rest of the :class:`~agentloop_core.protocol.AsyncServer` API is forwarded here,
once. Also :class:`BusyClock` and :class:`BusyTimeServer`, which measure how long an engine had
work (for the engine idle fraction a trainer reports per step)."""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from typing import Any

from agentloop_core.protocol import SamplingParams, ServerCapabilities, TokenOutput

__all__ = ["BusyClock", "BusyTimeServer", "ServerWrapper", "TransparentServerWrapper"]


class ServerWrapper:
    """Forwards the ``AsyncServer`` API to ``self.server``.

    Args:
        server: An engine adapter, or a client in front of several.
    """

    def __init__(self, server: Any) -> None:
        self.server = server

    @property
    def capabilities(self) -> ServerCapabilities:
        """The wrapped server's capabilities."""
        return self.server.capabilities

    async def generate(self, request_id: str, prompt_ids: list[int],
                       sampling_params: Mapping[str, Any] | SamplingParams | None = None,
                       **multi_modal: Any) -> TokenOutput:
        """See ``AsyncServer.generate`` (``multi_modal_data``, when given, passed on)."""
        return await self.server.generate(request_id, prompt_ids, sampling_params, **multi_modal)

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

    def forget_session(self, request_id: str) -> None:
        """See ``ServerCapabilities.forget_session`` (callers check the flag first)."""
        self.server.forget_session(request_id)


class TransparentServerWrapper(ServerWrapper):
    """A :class:`ServerWrapper` through which every other attribute of the engine is read too
    (``vocab_size``, ``tokenizer``, ``max_model_len``...), so loops that read them work
    unchanged behind it. Not for Ray actor bodies (their methods must be declared)."""

    def __getattr__(self, name: str) -> Any:
        # Only reached for attributes not defined on the wrapper.
        if name == "server":  # during unpickling, before __dict__ is filled
            raise AttributeError(name)
        return getattr(self.server, name)


class BusyClock:
    """Counts engine calls in flight and the wall seconds during which there was at least one."""

    def __init__(self) -> None:
        self.in_flight = 0
        """Calls in flight now."""
        self._since: float | None = None
        self._total = 0.0

    def enter(self) -> None:
        """A call starts."""
        if self.in_flight == 0:
            self._since = time.perf_counter()
        self.in_flight += 1

    def leave(self) -> None:
        """A call ends (also when it fails or is cancelled)."""
        self.in_flight -= 1
        if self.in_flight == 0 and self._since is not None:
            self._total += time.perf_counter() - self._since
            self._since = None

    def seconds(self) -> float:
        """Busy wall seconds so far, the current busy stretch included."""
        return self._total + (time.perf_counter() - self._since if self._since is not None else 0.0)


class BusyTimeServer(TransparentServerWrapper):
    """Measures the wall time during which at least one ``generate`` was in flight.

    A trainer reads :meth:`busy_seconds` at the start and end of a step: one minus the busy
    share of the step's wall time is the engine's idle fraction (the update, the weight push, a
    batch's tail waiting on slow tools). Everything else is forwarded unchanged.

    Args:
        server: An engine adapter, or a client in front of several.
    """

    def __init__(self, server: Any) -> None:
        super().__init__(server)
        self.clock = BusyClock()

    async def generate(self, request_id: str, prompt_ids: list[int],
                       sampling_params: Mapping[str, Any] | SamplingParams | None = None,
                       **multi_modal: Any) -> TokenOutput:
        """See ``AsyncServer.generate`` (timed)."""
        self.clock.enter()
        try:
            return await self.server.generate(request_id, prompt_ids, sampling_params, **multi_modal)
        finally:
            self.clock.leave()

    def busy_seconds(self) -> float:
        """Wall seconds so far with at least one ``generate`` in flight."""
        return self.clock.seconds()
