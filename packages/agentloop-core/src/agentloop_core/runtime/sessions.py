"""Telling the engine when a trajectory is over, so it can drop what it keeps for it.

An engine with ``capabilities.forget_session`` (HFServer's prefix cache, the routing client's
sticky sessions) keeps per-trajectory state keyed by the ``request_id`` a loop generates with,
and would otherwise hold it until its own bound pushes it out: a finished trajectory's last
turn, which no one reuses, then evicts a live trajectory's entry. Loops choose their own
request ids, so the worker learns them here: :class:`SessionRecordingServer` notes each id a
sample's loop generates with, and :class:`trajectory_sessions` (one per sample) forgets them
when the sample ends, however it ends (returned, failed, timed out or cancelled).
"""

from __future__ import annotations

import contextvars
import logging
from collections.abc import Mapping
from typing import Any

from agentloop_core.protocol import SamplingParams, TokenOutput
from agentloop_core.server_wrapper import TransparentServerWrapper

__all__ = ["SessionRecordingServer", "forgets_sessions", "trajectory_sessions"]

logger = logging.getLogger(__name__)

_IDS: contextvars.ContextVar[set[str] | None] = contextvars.ContextVar("agentloop_session_ids", default=None)


def forgets_sessions(server: Any) -> bool:
    """Whether ``server`` declares ``capabilities.forget_session``."""
    return bool(getattr(getattr(server, "capabilities", None), "forget_session", False))


class SessionRecordingServer(TransparentServerWrapper):
    """Forwards everything to ``server``; ``generate`` also notes its ``request_id`` in the
    current sample's :class:`trajectory_sessions` (outside one, nothing is noted)."""

    async def generate(
        self,
        request_id: str,
        prompt_ids: list[int],
        sampling_params: Mapping[str, Any] | SamplingParams | None = None,
        **multi_modal: Any,
    ) -> TokenOutput:
        """``generate`` on the wrapped server (``multi_modal_data``, when given, passed on)."""
        ids = _IDS.get()
        if ids is not None:
            ids.add(request_id)
        return await self.server.generate(request_id, prompt_ids, sampling_params, **multi_modal)


class trajectory_sessions:  # noqa: N801 - used as a function: ``with trajectory_sessions(server):``
    """Run the block (this asyncio task and the tasks it starts) as one trajectory; on exit,
    call ``server.forget_session`` for each request id a :class:`SessionRecordingServer` saw
    in it. A small class rather than a generator: a worker holds one open per sample in flight.

    Args:
        server: What to tell (the server the worker was given); None: record nothing.
    """

    __slots__ = ("_ids", "_server", "_token")

    def __init__(self, server: Any | None) -> None:
        self._server = server
        self._ids: set[str] = set()
        self._token: contextvars.Token[set[str] | None] | None = None

    def __enter__(self) -> None:
        if self._server is not None:
            self._token = _IDS.set(self._ids)

    def __exit__(self, *exc_info: object) -> None:
        if self._token is None or self._server is None:
            return
        _IDS.reset(self._token)
        self._token = None
        for request_id in self._ids:
            try:
                self._server.forget_session(request_id)
            except Exception as exc:  # noqa: BLE001 - a hint that failed costs memory, not the sample
                logger.warning("forget_session(%r) failed: %s: %s", request_id, type(exc).__name__, exc)
        self._ids.clear()
