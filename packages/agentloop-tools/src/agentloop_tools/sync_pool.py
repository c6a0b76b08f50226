"""A bounded thread pool for synchronous tool functions, one per tool.

A sync function cannot be interrupted: when the loop's ``timeout_s`` fires, the call is
abandoned but its thread keeps running until the function returns, possibly never. Run in
``asyncio.to_thread`` (the default executor, which the engine and every other
``run_in_executor(None, ...)`` share), enough such calls take every thread and the whole process
stalls. Here each tool gets its own few threads, a call abandoned while running counts as
*stuck* until its function returns, and once every thread of the pool is stuck new calls fail
at once with :class:`SyncToolPoolFullError` instead of queueing behind calls that may never
end. Calls abandoned while still queued never run and use no thread.

The threads are daemon threads, so a stuck function does not keep the process from exiting.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import functools
import queue
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["SyncToolPool", "SyncToolPoolFullError"]


class SyncToolPoolFullError(RuntimeError):
    """Every thread of a sync tool's pool is held by a call that timed out and has not returned."""


class SyncToolPool(concurrent.futures.Executor):
    """A fixed-size pool of daemon threads for one tool's sync function.

    Args:
        max_threads: Threads at most (started on demand).
        name: The tool's name, for thread names and errors.
    """

    def __init__(self, max_threads: int, name: str) -> None:
        if isinstance(max_threads, bool) or not isinstance(max_threads, int) or max_threads < 1:
            raise ValueError(f"tool {name!r}: max_sync_threads must be a positive integer, got {max_threads!r}")
        self.max_threads = max_threads
        self.name = name
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._pending = 0  # submitted and not finished (queued or running)
        self._stuck = 0
        self._rejected = 0

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            self._pending += 1
            if self._pending > len(self._threads) and len(self._threads) < self.max_threads:
                thread = threading.Thread(target=self._work, name=f"agentloop-sync-tool-{self.name}-"
                                          f"{len(self._threads)}", daemon=True)
                self._threads.append(thread)
                thread.start()
        self._queue.put((future, fn, args, kwargs))
        return future

    def _work(self) -> None:
        while True:
            future, fn, args, kwargs = self._queue.get()
            try:
                if future.set_running_or_notify_cancel():
                    try:
                        result = fn(*args, **kwargs)
                    except BaseException as exc:  # noqa: BLE001 - handed to the awaiting caller
                        future.set_exception(exc)
                    else:
                        future.set_result(result)
            finally:
                with self._lock:
                    self._pending -= 1

    def _unstick(self, _: concurrent.futures.Future) -> None:
        with self._lock:
            self._stuck -= 1

    async def run(self, fn: Callable[..., Any], /, **kwargs: Any) -> Any:
        """Call ``fn(**kwargs)`` on a pool thread (with the caller's context variables) and
        await its result.

        Raises:
            SyncToolPoolFullError: Every thread is stuck in a call that timed out.
            Exception: Whatever ``fn`` raises.
        """
        with self._lock:
            if self._stuck >= self.max_threads:
                self._rejected += 1
                raise SyncToolPoolFullError(
                    f"tool {self.name!r}: all {self.max_threads} threads of its pool are stuck in calls that "
                    "timed out and have not returned; the call was refused. Make the function return "
                    "(a timeout on its I/O), make it async, or raise the tool's max_sync_threads")
        context = contextvars.copy_context()
        future = self.submit(context.run, functools.partial(fn, **kwargs))
        try:
            return await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            # A call still queued was cancelled with it; a running one keeps its thread.
            if not future.cancel() and not future.done():
                with self._lock:
                    self._stuck += 1
                future.add_done_callback(self._unstick)
            raise

    @property
    def stats(self) -> dict[str, int]:
        """A snapshot: ``threads`` (the bound), ``started``, ``busy`` (queued or running calls), ``stuck``
        (running calls that were abandoned) and ``rejected`` (calls refused because all were stuck)."""
        with self._lock:
            return {"threads": self.max_threads, "started": len(self._threads), "busy": self._pending,
                    "stuck": self._stuck, "rejected": self._rejected}

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Nothing to do: the daemon threads idle on the queue and die with the process."""
