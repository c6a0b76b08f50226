"""Ids given one at a time from the event loop, sent in batches by one task.

:meth:`EngineHTTPClient.forget_session <agentloop_engines.fleet.http_client.EngineHTTPClient.forget_session>`
is a plain method called once per finished trajectory; a request for each would cost the
server one small request per trajectory (in ``bench/bench_forget_http.py``'s first version, a
request per trajectory made its 256 two-turn trajectories on the tiny model 1.6x slower end to
end). :class:`IdBatches` gathers the ids given within :data:`GATHER_S` of the first, or while a
batch is out, and sends them together, at most ``batch`` a request.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

logger = logging.getLogger(__name__)

GATHER_S = 0.05
"""How long a batch gathers ids before it is sent: a hint this late changes nothing the server
does (a finished trajectory's next turn never comes)."""


class IdBatches:
    """Send the ids given to :meth:`add` with ``send`` (one list at a time, at most ``batch``
    ids), from one task on the running event loop. A failed ``send`` is logged with ``what``,
    never raised: the ids are hints.

    Args:
        send: Sends one batch of ids (a request).
        batch: Most ids in one ``send``.
        what: What the ids are for, for the log (e.g. ``"http://host:8000: forget_session"``).
    """

    def __init__(self, send: Callable[[list[str]], Awaitable[object]], batch: int, what: str) -> None:
        if batch < 1:
            raise ValueError(f"batch must be >= 1, got {batch}")
        self._send = send
        self._batch = batch
        self._what = what
        self._ids: list[str] = []
        self._task: asyncio.Task[None] | None = None

    @property
    def task(self) -> asyncio.Task[None] | None:
        """The task sending, or None before the first id."""
        return self._task

    def add(self, request_id: str) -> None:
        """Queue ``request_id``; outside a running event loop it is dropped (nothing to send it on)."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        self._ids.append(request_id)
        task = self._task
        if task is None or task.done() or task.get_loop() is not loop:
            self._task = loop.create_task(self._run())

    async def drain(self) -> None:
        """Wait until the ids queued on this event loop are sent (or their sends failed)."""
        task = self._task
        if task is not None and task.get_loop() is asyncio.get_running_loop():
            await asyncio.gather(task, return_exceptions=True)

    async def _run(self) -> None:
        while self._ids:
            await asyncio.sleep(GATHER_S)  # the ids given meanwhile join this batch
            ids, self._ids = self._ids[: self._batch], self._ids[self._batch :]
            try:
                await self._send(ids)
            except Exception as exc:  # noqa: BLE001 - a hint that failed costs memory, not a sample
                logger.warning("%s failed for %d request ids (%s: %s); the server's own bound will age their "
                               "entries out", self._what, len(ids), type(exc).__name__, exc)
