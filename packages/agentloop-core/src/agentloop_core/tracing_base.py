"""Deprecated: use :mod:`agentloop_core.tracing.base` and :mod:`agentloop_core.tracing.redaction`
(removed in the next release).

A thin shim kept one release; every name it exports is the object of the new modules.
"""

import warnings

from agentloop_core.tracing.base import NullTracer, Tracer, current_tags, error_text, trace_context
from agentloop_core.tracing.redaction import (
    REDACTED,
    is_secret_key,
    redact,
    redact_span,
    redact_text,
    span_known_secrets,
    span_secrets,
)

# The names this module exported before the move.
__all__ = [
    "REDACTED", "NullTracer", "Tracer", "current_tags", "error_text", "is_secret_key", "redact", "redact_span",
    "redact_text", "span_known_secrets", "span_secrets", "trace_context",
]

warnings.warn(
    "agentloop_core.tracing_base is deprecated and will be removed in the next release; import from "
    "agentloop_core.tracing.base (Tracer, NullTracer, trace_context) or agentloop_core.tracing.redaction "
    "(redact, redact_text, is_secret_key) instead",
    DeprecationWarning,
    stacklevel=2,
)
