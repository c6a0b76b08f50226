"""Full garbage collections held off while rollouts are in flight.

Why: CPython's full (generation-2) collection walks every tracked object of the process, and
stops the event loop while it does. A trainer process holds a few hundred thousand objects
before the first rollout starts (torch, transformers, the tokenizer) and thousands of
trajectories add as many again, so with 4096 trajectories in flight each full collection
paused every loop for 0.2-0.7 s on this machine, six times a batch, and found nothing to free.

How: while at least one batch is in flight, the objects that existed before it are frozen
(``gc.freeze``: never walked again until unfrozen) and automatic full collections are off;
young (generation 0 and 1) collections run as usual, so a cycle that dies young is freed as
before. When the last batch in flight returns, everything is unfrozen and the thresholds are
restored: what became cyclic garbage meanwhile is freed by the next full collection, between
batches. A hold that lasts past ``max_hold_s`` (overlapping batches that never all finish,
as in asynchronous training) is broken at the next batch end by one full collection, so
cyclic garbage never waits longer than that.

A process where something else froze objects first (``gc.get_freeze_count() > 0``) is left
frozen as it was: only full collections are held off, and nothing is unfrozen.
"""

from __future__ import annotations

import gc
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

MAX_HOLD_S = 120.0
"""Longest a hold may keep full collections off before a batch end runs one."""

_FULL_OFF = 1 << 30
"""A generation-2 threshold no gen-1 count reaches: automatic full collections off."""


class GcHold:
    """Reference-counted hold on full collections, one per process (:data:`GC_HOLD`)."""

    def __init__(self, max_hold_s: float = MAX_HOLD_S) -> None:
        self.max_hold_s = max_hold_s
        self._lock = threading.Lock()
        self._holders = 0
        self._thresholds: tuple[int, int, int] | None = None
        self._froze = False
        self._since = 0.0
        self.breaks = 0
        """Full collections run because a hold outlasted ``max_hold_s``."""

    @property
    def held(self) -> bool:
        return self._holders > 0

    def acquire(self) -> None:
        with self._lock:
            self._holders += 1
            if self._holders > 1:
                return
            self._thresholds = gc.get_threshold()
            # Freeze only a heap nobody else froze: our release unfreezes everything.
            self._froze = gc.get_freeze_count() == 0
            if self._froze:
                gc.freeze()
            gen0, gen1, _ = self._thresholds
            gc.set_threshold(gen0, gen1, _FULL_OFF)
            self._since = time.monotonic()

    def release(self) -> None:
        with self._lock:
            if self._holders == 0:
                raise RuntimeError("GcHold.release() without a matching acquire()")
            self._holders -= 1
            if self._holders == 0:
                self._restore()
            elif time.monotonic() - self._since > self.max_hold_s:
                # Overlapping batches have kept the hold past its limit: one full collection
                # now, then the hold goes on over what survived it.
                if self._froze:
                    gc.unfreeze()
                gc.collect()
                if self._froze:
                    gc.freeze()
                self.breaks += 1
                self._since = time.monotonic()

    def _restore(self) -> None:
        if self._froze:
            gc.unfreeze()
            self._froze = False
        if self._thresholds is not None:
            gc.set_threshold(*self._thresholds)
            self._thresholds = None

    @contextmanager
    def holding(self, enabled: bool = True) -> Iterator[None]:
        """Hold full collections for the ``with`` block (nothing when not ``enabled``)."""
        if not enabled:
            yield
            return
        self.acquire()
        try:
            yield
        finally:
            self.release()


GC_HOLD = GcHold()
"""The process's hold, shared by every rollout worker in it."""
