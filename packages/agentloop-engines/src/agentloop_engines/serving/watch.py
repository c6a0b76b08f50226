"""What the HTTP servers do about clients that stop reading their answer or go away mid-request.

All are used by :mod:`agentloop_engines.serving.common` (so by the engine server and the gateway):

* :func:`write_deadline_protocol`: uvicorn's protocol, aborting a connection whose answer has
  not been read for ``write_timeout_s``. The transport pauses writing once the kernel's buffers
  and its own (64 KiB) are full; a client that reads nothing keeps it paused. A streamed answer
  then waits to send its next chunk, holding its in-flight slot; an answer sent whole sits in
  the transport's buffer, holding the connection (and the memory) after the request ended. A
  plain ``close`` would wait for that buffer to drain, which never happens, so it is ``abort``.
* :func:`header_deadline_protocol`: the same, also timing a request head from its first byte
  (slowloris) and a new connection's silence, and never closing a connection for silence
  while its next request waits in the kernel.
* :func:`serve_until_gone`: runs the app for one admitted request and cancels it when the
  client disconnects before its answer is complete, so a generation nobody waits for stops
  (cancelling ``generate`` is how every engine is told: HFServer stops decoding that row) and
  the slot is freed at once. ASGI servers only tell an app of a disconnect through ``receive``,
  which a handler waiting on the engine never calls.
"""

from __future__ import annotations

import asyncio
import logging
from array import array
from typing import Any

logger = logging.getLogger(__name__)

__all__ = ["header_deadline_protocol", "serve_until_gone", "write_deadline_protocol"]


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


def header_deadline_protocol(timeout_s: float, first_byte_timeout_s: float, write_timeout_s: float) -> type:
    """uvicorn's h11 protocol with two clocks on a request head, and the write deadline of
    :func:`write_deadline_protocol` (``write_timeout_s``).

    - A head must be whole ``timeout_s`` after its first byte arrived: uvicorn's keep-alive timer
      stops at the first byte, so a client sending a head a byte at a time (slowloris) would
      otherwise hold its connection forever. The body is timed by
      :class:`~agentloop_engines.serving.common.RequestGuard`.
    - A new connection that sends nothing is closed after ``first_byte_timeout_s`` (between
      requests, uvicorn's keep-alive timer bounds silence).
    - Neither silence timer closes a connection whose next bytes already wait in the kernel
      (a request written as the timer fired, not yet read by a busy event loop): closing it
      would reset a request on its way, the keep-alive race every client whose idle expiry is
      close to the server's (httpx: 5 s, as uvicorn's) can hit.

    The head's clock never runs before the client has sent anything: a connection opened by a
    client that is then slow to write (a process starved of CPU with hundreds of requests to
    send) would otherwise be closed under a request already on its way, which that client sees
    as a reset. A new request cycle means the head arrived.
    """
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class HeaderDeadlineProtocol(write_deadline_protocol(H11Protocol, write_timeout_s)):
        _deadline_generation = 0
        _head_clock_running = False

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self._arm_deadline(first_byte_timeout_s, silence=True)

        def timeout_keep_alive_handler(self) -> None:
            if not _bytes_waiting(self.transport):
                super().timeout_keep_alive_handler()
            # else data_received comes next and stops the keep-alive timer (it runs once)

        def data_received(self, data: bytes) -> None:
            if not self._head_clock_running and self._between_requests():
                self._head_clock_running = True  # this is the first byte of the next head
                self._arm_deadline(timeout_s)
            super().data_received(data)

        def on_response_complete(self) -> None:
            self._head_clock_running = False
            self._deadline_generation += 1  # whatever was armed was for the request just answered
            super().on_response_complete()
            if self._between_requests() and self.conn.trailing_data[0]:
                # Part of the next (pipelined) head is already buffered: its clock starts now.
                self._head_clock_running = True
                self._arm_deadline(timeout_s)

        def _between_requests(self) -> bool:
            return self.cycle is None or self.cycle.response_complete

        def _arm_deadline(self, seconds: float, silence: bool = False) -> None:
            self._deadline_generation += 1
            generation, cycle = self._deadline_generation, self.cycle

            def expire() -> None:
                if (generation == self._deadline_generation and self.cycle is cycle and self._between_requests()
                        and not self.transport.is_closing()
                        and not (silence and _bytes_waiting(self.transport))):
                    self.transport.close()

            self.loop.call_later(seconds, expire)

    return HeaderDeadlineProtocol


def _bytes_waiting(transport: Any) -> bool:
    """Whether the kernel holds bytes of ``transport``'s socket not yet read (FIONREAD); False
    where that cannot be asked (no socket, a platform without the ioctl)."""
    sock = transport.get_extra_info("socket")
    try:
        import fcntl
        import termios

        count = array("i", [0])
        fcntl.ioctl(sock.fileno(), termios.FIONREAD, count, True)
    except (ImportError, AttributeError, OSError, ValueError):
        return False
    return count[0] > 0
