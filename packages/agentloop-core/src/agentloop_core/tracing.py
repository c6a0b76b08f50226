"""Rollout tracing: spans for each generate, tool call and reward.

This module holds the tracer interface and the no-op tracer. Backends (JSONL, MLflow) build on
:class:`Tracer`.
"""

from __future__ import annotations

import contextvars
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

_TRACE_TAGS: contextvars.ContextVar[dict[str, Any]] = contextvars.ContextVar("agentloop_trace_tags", default={})


@contextmanager
def trace_context(**tags: Any) -> Iterator[None]:
    """Tag every span opened inside (this asyncio task and its children) with ``tags``,
    e.g. ``step``, ``sample_index``, ``rollout_n``."""
    token = _TRACE_TAGS.set({**_TRACE_TAGS.get(), **tags})
    try:
        yield
    finally:
        _TRACE_TAGS.reset(token)


def current_tags() -> dict[str, Any]:
    return dict(_TRACE_TAGS.get())


class Tracer:
    """Base tracer: times spans and hands finished ones to :meth:`emit`."""

    @contextmanager
    def span(self, name: str, **attributes: Any) -> Iterator[dict[str, Any]]:
        """Time a block. The yielded dict can be filled with more attributes inside the block."""
        record: dict[str, Any] = {"name": name, **current_tags(), **attributes}
        start_wall = time.time()
        start = time.perf_counter()
        try:
            yield record
        except BaseException as exc:
            record["error"] = f"{type(exc).__name__}: {exc}"
            raise
        finally:
            record["start_time"] = start_wall
            record["duration_s"] = time.perf_counter() - start
            self.emit(record)

    def emit(self, record: dict[str, Any]) -> None:
        """Store one finished span."""

    def flush(self) -> None:
        """Write buffered spans."""

    def close(self) -> None:
        self.flush()


class NullTracer(Tracer):
    """Times nothing, stores nothing."""

    @contextmanager
    def span(self, name: str, **attributes: Any) -> Iterator[dict[str, Any]]:
        yield {}
