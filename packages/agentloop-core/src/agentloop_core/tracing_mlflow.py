"""Deprecated: use :mod:`agentloop_core.tracing.mlflow` (removed in the next release).

A thin shim kept one release; every name it exports is the object of the new module.
"""

import warnings

from agentloop_core.tracing.mlflow import MLflowTracer

__all__ = ["MLflowTracer"]

warnings.warn(
    "agentloop_core.tracing_mlflow is deprecated and will be removed in the next release; import from "
    "agentloop_core.tracing.mlflow instead (e.g. `from agentloop_core.tracing.mlflow import MLflowTracer`)",
    DeprecationWarning,
    stacklevel=2,
)
