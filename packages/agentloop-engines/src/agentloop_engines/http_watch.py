"""What the HTTP servers do about clients that stop reading their answer or go away mid-request.

Both are used by :mod:`agentloop_engines.http_common` (so by the engine server and the gateway):

* :func:`write_deadline_protocol`: uvicorn's protocol, aborting a connection whose answer has
  not been read for ``write_timeout_s``. The transport pauses writing once the kernel's buffers
  and its own (64 KiB) are full; a client that reads nothing keeps it paused. A streamed answer
  then waits to send its next chunk, holding its in-flight slot; an answer sent whole sits in
  the transport's buffer, holding the connection (and the memory) after the request ended. A
  plain ``close`` would wait for that buffer to drain, which never happens, so it is ``abort``.
* :func:`serve_until_gone`: runs the app for one admitted request and cancels it when the
  client disconnects before its answer is complete, so a generation nobody waits for stops
  (cancelling ``generate`` is how every engine is told: HFServer stops decoding that row) and
  the slot is freed at once. ASGI servers only tell an app of a disconnect through ``receive``,
  which a handler waiting on the engine never calls.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

logger = logging.getLogger(__name__)

__all__ = ["serve_until_gone", "write_deadline_protocol"]


def write_deadline_protocol(base: Any, timeout_s: float) -> type:
    """``base`` (an asyncio HTTP protocol class, uvicorn's) aborting a connection whose writing
    has stayed paused (the client not reading) for ``timeout_s`` seconds.

    A client that keeps reading resumes writing each time the buffer drains below the low-water
    mark, which restarts the deadline; so what it must do is read at least the transport's
    buffer (tens of KiB) every ``timeout_s``.
    """

    class WriteDeadlineProtocol(base):
        _write_generation = 0

        def pause_writing(self) -> None:
            super().pause_writing()
            self._write_generation += 1
            self.loop.call_later(timeout_s, self._write_expired, self._write_generation)

        def resume_writing(self) -> None:
            self._write_generation += 1
            super().resume_writing()

        def _write_expired(self, generation: int) -> None:
            if generation != self._write_generation:
                return
            logger.info("aborted the connection of %s: it read none of its answer for %gs (ServerLimits."
                        "write_timeout_s)", getattr(self, "client", None), timeout_s)
            # connection_lost follows: uvicorn marks the request disconnected and wakes its send.
            self.transport.abort()

    return WriteDeadlineProtocol


async def serve_until_gone(app: Any, scope: dict[str, Any], body: bytes, receive: Any, send: Any) -> None:
    """Run ``app`` on a request whose whole ``body`` was read already; cancel it if the client
    disconnects before the last byte of the answer was handed to the server.

    The app reads ``body`` from its ``receive``, then (as from any ASGI server) an
    ``http.disconnect`` once the client has gone or the answer is complete.

    Raises:
        Exception: Whatever the app raised, unless it was cancelled here.
    """
    gone = asyncio.Event()
    replayed = False
    answered = False

    async def app_receive() -> dict[str, Any]:
        nonlocal replayed
        if not replayed:
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def app_send(message: dict[str, Any]) -> None:
        nonlocal answered
        if message.get("type") == "http.response.body" and not message.get("more_body", False):
            answered = True
        await send(message)

    task = asyncio.ensure_future(app(scope, app_receive, app_send))
    watcher = asyncio.ensure_future(_until_disconnect(receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if watcher.done() and not task.done():
            gone.set()
            if not answered:
                logger.debug("the client of %s %s went away before its answer; cancelled the request",
                             scope.get("method"), scope.get("path"))
                task.cancel()
        await asyncio.wait({task})
        if not task.cancelled():
            task.result()
    finally:
        watcher.cancel()
        if watcher.done() and not watcher.cancelled():
            watcher.exception()  # retrieved: a failing receive means the client is gone anyway
        if not task.done():  # this request itself was cancelled (server shutdown)
            task.cancel()


async def _until_disconnect(receive: Any) -> None:
    # After the body, the server's receive returns only when the client has gone or the answer
    # is complete; anything else (a spurious empty body message) is skipped.
    while (await receive())["type"] != "http.disconnect":
        pass
