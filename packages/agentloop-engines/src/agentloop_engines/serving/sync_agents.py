"""The threads ``http_agent`` runs synchronous agents on: a bounded pool of their own.

A synchronous agent blocks its thread for its whole run, on HTTP calls that only the engine can
answer. On the event loop's default executor (``asyncio.to_thread``) it shares threads with
everything else that runs there, an engine's compute included: with as many running agents as
that executor has threads (``min(32, cpu_count + 4)``), the engine's work waits for a thread that
every agent holds while waiting for the engine, and the rollout hangs. So agents get threads of
their own here, and the engines run their compute on executors of their own
(:mod:`agentloop_engines.adapters.hf.server`).

Samples past the pool's size wait for a thread (FIFO) instead of failing: every running agent
makes progress, so a thread comes free. A sample's ``timeout_s`` starts when its agent starts,
not while it waits. A sync agent cannot be interrupted: one that runs past its timeout is
abandoned, but keeps its thread until it returns (it is *stuck*). Once every thread is stuck no
sample could ever start, so the waiting samples and any new one fail at once with
:class:`SyncAgentPoolFullError` naming the setting.

The threads are daemon threads, so a stuck agent does not keep the process from exiting.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import contextvars
import functools
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["DEFAULT_SYNC_AGENT_THREADS", "SyncAgentPool", "SyncAgentPoolFullError", "check_threads", "sync_agent_pool"]

DEFAULT_SYNC_AGENT_THREADS = 256
"""Threads of the pool when ``max_sync_agent_threads`` is not set: a thread costs little while it
waits on HTTP, and this is more than most rollouts run at once."""


def check_threads(max_threads: Any) -> int:
    """``max_threads`` if it is a positive integer.

    Raises:
        ValueError: naming ``max_sync_agent_threads`` otherwise.
    """
    if isinstance(max_threads, bool) or not isinstance(max_threads, int) or max_threads < 1:
        raise ValueError(f"http_agent: max_sync_agent_threads must be a positive integer, got {max_threads!r}")
    return max_threads


class SyncAgentPoolFullError(RuntimeError):
    """Every thread of the sync-agent pool is held by an agent that ran past its timeout."""


class SyncAgentPool:
    """A fixed number of daemon threads running synchronous agents, one agent per thread.

    Args:
        max_threads: Threads at most (started on demand).
    """

    def __init__(self, max_threads: int) -> None:
        self.max_threads = check_threads(max_threads)
        self._lock = threading.Lock()
        self._jobs: collections.deque[tuple[concurrent.futures.Future, Callable[[], Any]]] = collections.deque()
        self._ready = threading.Condition(self._lock)
        self._threads: list[threading.Thread] = []
        self._idle = 0
        self._stuck = 0
        self._rejected = 0
        # Samples waiting for a thread, so they can be told when none will ever come free.
        self._waiting: dict[concurrent.futures.Future, tuple[asyncio.AbstractEventLoop, asyncio.Future]] = {}

    def _submit(self, job: Callable[[], Any]) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            self._jobs.append((future, job))
            if self._idle == 0 and len(self._threads) < self.max_threads:
                thread = threading.Thread(target=self._work, name=f"agentloop-sync-agent-{len(self._threads)}",
                                          daemon=True)
                self._threads.append(thread)
                thread.start()
            else:
                self._ready.notify()
        return future

    def _work(self) -> None:
        while True:
            with self._lock:
                self._idle += 1
                while not self._jobs:
                    self._ready.wait()
                self._idle -= 1
                future, job = self._jobs.popleft()
            if future.set_running_or_notify_cancel():
                try:
                    result = job()
                except BaseException as exc:  # noqa: BLE001 - handed to the awaiting sample
                    future.set_exception(exc)
                else:
                    future.set_result(result)

    async def run(self, fn: Callable[..., Any], /, *args: Any, timeout_s: float | None) -> Any:
        """Call ``fn(*args)`` on a pool thread (with the caller's context variables) once one is
        free, and await its result for at most ``timeout_s`` from when it started.

        Raises:
            SyncAgentPoolFullError: Every thread is stuck in an agent that ran past its timeout.
            TimeoutError: ``fn`` ran past ``timeout_s``; its thread stays stuck until it returns.
            Exception: Whatever ``fn`` raises.
        """
        self._refuse_if_stuck()
        loop = asyncio.get_running_loop()
        started: asyncio.Future[None] = loop.create_future()
        context = contextvars.copy_context()
        call = functools.partial(context.run, fn, *args)

        def job() -> Any:
            with self._lock:
                self._waiting.pop(future, None)
            _call_soon(loop, _set_result, started)
            return call()

        future = self._submit(job)
        with self._lock:
            if not future.running() and not future.done():
                self._waiting[future] = (loop, started)
        try:
            await started
            async with asyncio.timeout(timeout_s):
                return await asyncio.wrap_future(future)
        except TimeoutError as exc:
            self._abandon(future)
            raise TimeoutError(f"http_agent: the agent ran past timeout_s={timeout_s:g}s; raise timeout_s in the "
                               "loop config, or make the agent finish sooner (its thread stays busy until it "
                               "returns)") from exc
        except BaseException:
            # Cancelled while waiting for a thread: it never runs. Cancelled while running: abandoned.
            self._abandon(future)
            raise
        finally:
            with self._lock:
                self._waiting.pop(future, None)

    def _refuse_if_stuck(self) -> None:
        with self._lock:
            if self._stuck >= self.max_threads:
                self._rejected += 1
                raise SyncAgentPoolFullError(self._full_message())

    def _full_message(self) -> str:
        return (f"http_agent: all {self.max_threads} threads that run synchronous agents are held by agents that "
                "ran past timeout_s and have not returned, so no sample can start; make the agent return (a timeout "
                "on its client: openai.OpenAI(timeout=...)), make it async, or raise max_sync_agent_threads in the "
                "loop config")

    def _abandon(self, future: concurrent.futures.Future) -> None:
        if future.cancel() or future.done():
            return
        with self._lock:
            self._stuck += 1
            if self._stuck < self.max_threads:
                waiting = []
            else:
                # No thread will come free while they stay stuck: tell every waiting sample now.
                waiting = list(self._waiting.items())
                self._waiting.clear()
                self._rejected += len(waiting)
        future.add_done_callback(self._unstick)
        for queued, (loop, started) in waiting:
            queued.cancel()
            _call_soon(loop, _set_exception, started, SyncAgentPoolFullError(self._full_message()))

    def _unstick(self, _: concurrent.futures.Future) -> None:
        with self._lock:
            self._stuck -= 1

    @property
    def stats(self) -> dict[str, int]:
        """A snapshot: ``threads`` (the bound), ``started``, ``waiting`` (samples waiting for a
        thread), ``stuck`` (running agents that were abandoned) and ``rejected``."""
        with self._lock:
            return {"threads": self.max_threads, "started": len(self._threads), "waiting": len(self._jobs),
                    "stuck": self._stuck, "rejected": self._rejected}


def _call_soon(loop: asyncio.AbstractEventLoop, fn: Callable[..., Any], *args: Any) -> None:
    with contextlib.suppress(RuntimeError):  # the sample's event loop is closed: nobody waits any more
        loop.call_soon_threadsafe(fn, *args)


def _set_result(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)


def _set_exception(future: asyncio.Future, exc: BaseException) -> None:
    if not future.done():
        future.set_exception(exc)


_POOLS: dict[int, SyncAgentPool] = {}
_POOLS_LOCK = threading.Lock()


def sync_agent_pool(max_threads: int = DEFAULT_SYNC_AGENT_THREADS) -> SyncAgentPool:
    """The process's pool of ``max_threads`` threads (one per size, shared by every loop that
    asks for that size, so threads are not started per sample).

    Raises:
        ValueError: when ``max_threads`` is not a positive integer.
    """
    check_threads(max_threads)
    with _POOLS_LOCK:
        pool = _POOLS.get(max_threads)
        if pool is None:
            pool = _POOLS[max_threads] = SyncAgentPool(max_threads)
        return pool
