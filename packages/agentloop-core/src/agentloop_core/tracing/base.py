"""The tracer interface: :class:`Tracer` (times spans, hands finished ones to ``emit``), the
no-op :class:`NullTracer`, and the trace tags every span carries (:func:`trace_context`).

Backends (:mod:`agentloop_core.tracing.jsonl`, :mod:`agentloop_core.tracing.mlflow`) subclass
:class:`Tracer` and redact with :mod:`agentloop_core.tracing.redaction`; neither imports the
package that picks them (:func:`agentloop_core.tracing.make_tracer`).
"""

from __future__ import annotations

import contextvars
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from agentloop_core.tracing.redaction import span_secrets

__all__ = ["NullTracer", "Tracer", "current_tags", "error_text", "trace_context"]

# Never mutated in place (trace_context sets a new dict), so a shared empty default is safe.
_TRACE_TAGS: contextvars.ContextVar[dict[str, Any]] = contextvars.ContextVar(
    "agentloop_trace_tags", default={}  # noqa: B039
)


class trace_context:  # noqa: N801 - used as a function: ``with trace_context(step=3):``
    """Tag every span opened inside (this asyncio task and its children) with ``tags``,
    e.g. ``step``, ``sample_index``, ``rollout_n``.

    A small class rather than a generator: a rollout worker holds one open per sample in
    flight, thousands at once."""

    __slots__ = ("_tags", "_token")

    def __init__(self, **tags: Any) -> None:
        self._tags = tags
        self._token: contextvars.Token[dict[str, Any]] | None = None

    def __enter__(self) -> None:
        # Outside any other trace_context the tags are the set itself (a dict of this object's
        # own, made from the keywords): one dict per sample in flight, not two.
        outer = _TRACE_TAGS.get()
        self._token = _TRACE_TAGS.set({**outer, **self._tags} if outer else self._tags)

    def __exit__(self, *exc_info: object) -> None:
        if self._token is not None:
            _TRACE_TAGS.reset(self._token)
            self._token = None


def current_tags() -> dict[str, Any]:
    """The tags :func:`trace_context` set around the caller (a copy)."""
    return dict(_TRACE_TAGS.get())


def error_text(exc: BaseException) -> str:
    """How a span records an error: ``Type: message`` (redact it before storing)."""
    return f"{type(exc).__name__}: {exc}"


class Tracer:
    """Base tracer: times spans and hands finished ones to :meth:`emit`."""

    token2text: bool = False
    """Whether the rollout worker puts each trajectory's prompt and response, decoded, on its
    ``agent_loop`` span (verl's ``rollout.trace.token2text``)."""

    @contextmanager
    def span(self, name: str, **attributes: Any) -> Iterator[dict[str, Any]]:
        """Time a block. The yielded dict can be filled with more attributes inside the block."""
        record: dict[str, Any] = {"name": name, **current_tags(), **attributes}
        start_wall = time.time()
        start = time.perf_counter()
        with span_secrets(record):
            try:
                yield record
            except BaseException as exc:
                record["error"] = error_text(exc)
                raise
            finally:
                record["start_time"] = start_wall
                record["duration_s"] = time.perf_counter() - start
                self.emit(record)

    def emit(self, record: dict[str, Any]) -> None:
        """Store one finished span. Called inside the span's secret scope, so
        :func:`redact_span` masks the secrets of enclosing spans too."""

    def flush(self) -> None:
        """Write buffered spans."""

    def close(self) -> None:
        self.flush()


class _NullSpan:
    """A :class:`NullTracer` span: a fresh dict to fill in, and nothing else (no generator
    frame held while the block runs)."""

    __slots__ = ()

    def __enter__(self) -> dict[str, Any]:
        return {}

    def __exit__(self, *exc_info: object) -> None:
        return None


_NULL_SPAN = _NullSpan()


class NullTracer(Tracer):
    """Times nothing, stores nothing."""

    def span(self, name: str, **attributes: Any) -> Any:  # the base's context manager, without a generator
        return _NULL_SPAN
