"""Drive an engine that owns its own asyncio event loop from any other loop or thread.

SGLang's ``Engine`` creates ``engine.loop`` at construction; its ``async_generate`` must be
awaited on that loop (awaiting it under a fresh ``asyncio.run()`` hangs), while its control
methods (``update_weights_from_tensor``, ``release_memory_occupation``, ...) are synchronous
and call ``engine.loop.run_until_complete`` themselves, which fails while the loop runs.
:class:`EngineLoopThread` runs the loop in a daemon thread for generation and pauses it for
those synchronous calls.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

T = TypeVar("T")

__all__ = ["EngineLoopThread"]


class EngineLoopThread:
    """Runs ``loop`` forever in a daemon thread, except while :meth:`call_paused` runs.

    Args:
        loop: The engine's event loop; it must not be running yet.
        name: Thread name, for debugging.

    Raises:
        RuntimeError: when ``loop`` is already running (some other thread owns it).
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, name: str = "engine-loop") -> None:
        if loop.is_running():
            raise RuntimeError(
                "the engine's event loop is already running in another thread; create the engine "
                "outside a running event loop (e.g. before asyncio.run) so the adapter can drive it"
            )
        self.loop = loop
        # want_run/running are guarded by one condition so a pause never mistakes a stale
        # "stopped" for the loop being stopped now.
        self._cond = threading.Condition()
        self._want_run = True
        self._running = False
        self._closed = False
        self._pause_lock = threading.Lock()
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._thread.start()

    def _main(self) -> None:
        asyncio.set_event_loop(self.loop)
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._want_run or self._closed)
                if self._closed:
                    return
                self._running = True
            try:
                self.loop.run_forever()
            finally:
                with self._cond:
                    self._running = False
                    self._cond.notify_all()

    async def run(self, coro: Awaitable[T]) -> T:
        """Await ``coro`` on the engine loop, from the caller's loop."""
        fut = asyncio.run_coroutine_threadsafe(coro, self.loop)  # type: ignore[arg-type]
        try:
            return await asyncio.wrap_future(fut)
        except asyncio.CancelledError:
            fut.cancel()
            raise

    def call_soon(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run a plain (non-blocking) function on the engine loop's thread."""
        self.loop.call_soon_threadsafe(fn, *args)

    def call_paused(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Stop the loop, run ``fn`` (which may ``loop.run_until_complete``), restart the loop.

        Blocking: call it from a worker thread (``asyncio.to_thread``), never on the engine loop.
        Requests in flight are suspended meanwhile and resume afterwards.
        """
        with self._pause_lock:
            with self._cond:
                self._want_run = False
                if self._running:
                    self.loop.call_soon_threadsafe(self.loop.stop)
                self._cond.wait_for(lambda: not self._running)
            try:
                return fn(*args, **kwargs)
            finally:
                with self._cond:
                    self._want_run = True
                    self._cond.notify_all()

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop the loop thread (the loop itself is left to its owner to close)."""
        with self._cond:
            self._closed = True
            if self._running:
                self.loop.call_soon_threadsafe(self.loop.stop)
            self._cond.notify_all()
        self._thread.join(timeout=timeout_s)
