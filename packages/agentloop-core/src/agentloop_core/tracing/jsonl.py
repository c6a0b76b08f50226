"""A tracer that appends one JSON line per finished span to a file; no extra dependency."""

from __future__ import annotations

import contextvars
import json
import math
import os
import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from agentloop_core.tracing.base import Tracer
from agentloop_core.tracing.redaction import redact_span

__all__ = ["JsonlTracer", "read_spans"]

_CURRENT_SPAN: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "agentloop_jsonl_span", default=None
)


def _jsonable(value: Any) -> Any:
    # numpy scalars and arrays, sets, dataclasses-as-repr: spans must never fail to serialise.
    if hasattr(value, "tolist"):
        return value.tolist()
    if isinstance(value, (set, frozenset)):
        return sorted(value, key=repr)
    return repr(value)


def _finite(value: Any) -> Any:
    # JSON has no NaN/Infinity; write null so any JSON reader can load the line.
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


class JsonlTracer(Tracer):
    """Appends each finished span as one JSON object per line.

    Each line holds ``name``, ``span_id``, ``parent_id`` (the enclosing span in the same asyncio
    task, or null), the tags from :func:`~agentloop_core.tracing.trace_context` (``step``,
    ``sample_index``, ``rollout_n``...), the span's attributes (secrets redacted),
    ``start_time`` (Unix seconds), ``duration_s`` and ``error`` when the block raised.

    Every line is written with a single ``write`` on a file opened with ``O_APPEND``, so several
    processes (e.g. Ray rollout workers) can append to the same file without interleaving
    lines. The tracer pickles as its path, so it can be sent to a Ray actor.

    Args:
        path: The ``.jsonl`` file; parent folders are created.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._fd: int | None = None
        self._lock = threading.Lock()

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (str(self.path),))

    def _open(self) -> int:
        if self._fd is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        return self._fd

    @contextmanager
    def span(self, name: str, **attributes: Any) -> Iterator[dict[str, Any]]:
        """Time a block and append it as one line; the yielded dict takes more attributes."""
        span_id = uuid.uuid4().hex[:16]
        parent_id = _CURRENT_SPAN.get()
        token = _CURRENT_SPAN.set(span_id)
        try:
            with super().span(name, **attributes) as record:
                record["span_id"] = span_id
                record["parent_id"] = parent_id
                yield record
        finally:
            _CURRENT_SPAN.reset(token)

    def emit(self, record: dict[str, Any]) -> None:
        """Append one finished span."""
        line = json.dumps(_finite(redact_span(record)), default=_jsonable, ensure_ascii=False) + "\n"
        data = line.encode("utf-8")
        with self._lock:
            fd = self._open()
            written = os.write(fd, data)
            while written < len(data):  # short writes are rare but legal
                written += os.write(fd, data[written:])

    def flush(self) -> None:
        """Push written lines to disk."""
        with self._lock:
            if self._fd is not None:
                os.fsync(self._fd)

    def close(self) -> None:
        """Close the file; a later span reopens it."""
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None


def read_spans(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Load every span a :class:`JsonlTracer` wrote to ``path``."""
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]
