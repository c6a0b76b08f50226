"""A short thread switch interval while rollouts are in flight.

Why: a sync tool runs on threads of its own (``agentloop_tools.sync_pool``), and each call
must take the GIL from the event-loop thread, which, busy with thousands of trajectories, gives
it up only when the switch interval (``sys.getswitchinterval()``, Python's default 5 ms) says
so. The calls then wait in line for those hand-overs and their results come back in bursts: at
16384 trajectories, 3 calculator calls each, a call took 228 ms (median; p99 857 ms) and the
loop's lag p99 was 57-70 ms; with a 2 ms interval 35 ms (p99 80 ms) and 17-19 ms, at the same
throughput (``bench/bench_scale.py``, 2026-12-06). A shorter interval only makes the GIL change
hands more often; what every thread computes is unchanged. 2 ms, not less: at 1 ms the main
job's GRPO (its engine on a thread of its own) took 1.03x as long; at 2 ms 1.01x, within noise.

How: while at least one batch is in flight, the interval is at most the worker's
``switch_interval_s`` (never raised: a process that set a shorter one keeps it). When the last
batch returns, the interval from before the first is restored, unless something else changed
it meanwhile: then that setting stays.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager


class SwitchIntervalHold:
    """Reference-counted hold on ``sys.setswitchinterval``, one per process (:data:`SWITCH_INTERVAL`)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._holders = 0
        self._before: float | None = None  # the interval before the first holder
        self._set: float | None = None  # the interval this hold last set

    @property
    def held(self) -> bool:
        return self._holders > 0

    def acquire(self, interval_s: float) -> None:
        with self._lock:
            self._holders += 1
            current = sys.getswitchinterval()
            if self._holders == 1:
                self._before, self._set = current, None
            if interval_s < current:
                sys.setswitchinterval(interval_s)
                self._set = sys.getswitchinterval()  # as the interpreter stores it

    def release(self) -> None:
        with self._lock:
            if self._holders == 0:
                raise RuntimeError("SwitchIntervalHold.release() without a matching acquire()")
            self._holders -= 1
            if self._holders == 0:
                if self._set is not None and self._before is not None and sys.getswitchinterval() == self._set:
                    sys.setswitchinterval(self._before)
                self._before = self._set = None

    @contextmanager
    def holding(self, interval_s: float | None) -> Iterator[None]:
        """Hold the interval at most ``interval_s`` for the ``with`` block (None: nothing)."""
        if interval_s is None:
            yield
            return
        self.acquire(interval_s)
        try:
            yield
        finally:
            self.release()


SWITCH_INTERVAL = SwitchIntervalHold()
"""The process's hold, shared by every rollout worker in it."""
