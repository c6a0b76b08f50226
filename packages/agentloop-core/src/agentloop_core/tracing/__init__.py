"""Rollout tracing: spans for each generate, tool call and reward.

- :mod:`~agentloop_core.tracing.base`: the :class:`Tracer` interface, the no-op tracer and the
  trace tags (:func:`trace_context`).
- :mod:`~agentloop_core.tracing.redaction`: what counts as a secret and how it is masked.
- :mod:`~agentloop_core.tracing.jsonl`, :mod:`~agentloop_core.tracing.mlflow`: the backends.

:func:`make_tracer` picks a backend by config and imports it only then, so MLflow loads only
for a run that traces to it.
"""

from __future__ import annotations

import inspect
from typing import Any

from agentloop_core.tracing.base import NullTracer, Tracer, current_tags, trace_context
from agentloop_core.tracing.redaction import REDACTED, is_secret_key, redact, redact_text

__all__ = [
    "REDACTED",
    "TRACER_BACKENDS",
    "NullTracer",
    "Tracer",
    "current_tags",
    "is_secret_key",
    "make_tracer",
    "redact",
    "redact_text",
    "trace_context",
]

TRACER_BACKENDS = ("none", "jsonl", "mlflow")


def make_tracer(config: Any = None) -> Tracer:
    """Build a tracer from a config mapping.

    Args:
        config: ``None`` or ``{"backend": "none"}`` for no tracing;
            ``{"backend": "jsonl", "path": "spans.jsonl"}``;
            ``{"backend": "mlflow", "tracking_uri": "sqlite:///mlflow.db", "experiment": "rollouts",
            "artifact_location": "/tmp/mlflow-artifacts"}``. A :class:`Tracer` instance is
            returned unchanged.

    Returns:
        The tracer.

    Raises:
        ValueError: on an unknown backend or option, naming the valid ones.
    """
    if isinstance(config, Tracer):
        return config
    options = dict(config or {})
    backend = str(options.pop("backend", "none")).lower()
    if backend == "none":
        if options:
            raise ValueError(f"tracing backend 'none' takes no options, got {sorted(options)}")
        return NullTracer()
    if backend == "jsonl":
        from agentloop_core.tracing.jsonl import JsonlTracer

        return _construct(JsonlTracer, backend, options)
    if backend == "mlflow":
        from agentloop_core.tracing.mlflow import MLflowTracer

        return _construct(MLflowTracer, backend, options)
    raise ValueError(
        f"unknown tracing backend {backend!r}; valid backends: {', '.join(TRACER_BACKENDS)}"
    )


def _construct(cls: type, backend: str, options: dict[str, Any]) -> Tracer:
    valid = [p for p in inspect.signature(cls.__init__).parameters if p != "self"]
    unknown = sorted(set(options) - set(valid))
    if unknown:
        raise ValueError(
            f"unknown option(s) {unknown} for tracing backend {backend!r}; valid options: {', '.join(valid)}"
        )
    return cls(**options)
