"""A tracer that records spans as MLflow traces, offline (e.g. a sqlite tracking store)."""

from __future__ import annotations

import importlib
import os
import tempfile
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from agentloop_core.tracing.base import Tracer, current_tags, error_text
from agentloop_core.tracing.redaction import redact_span, redact_text, span_known_secrets, span_secrets

__all__ = ["MLflowTracer"]

_INSTALL_HINT = 'MLflow tracing needs mlflow: pip install "agentloop-core[mlflow]"'


def _import_mlflow(module: str = "mlflow") -> Any:
    """The MLflow package or one of its modules. Imported by name: a static checker (pyright)
    resolves ``import mlflow`` written in this file, ``tracing/mlflow.py``, to the file itself."""
    # MLflow phones home unless told not to; nothing here may reach the network.
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ImportError(_INSTALL_HINT) from exc


def _attr(value: Any) -> Any:
    # MLflow serialises attributes as JSON; keep primitives and containers, repr the rest.
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, dict):
        return {str(k): _attr(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_attr(v) for v in value]
    if hasattr(value, "tolist"):
        return value.tolist()
    return repr(value)


def _record_error(live: Any, exc: BaseException, description: str, known: frozenset[str]) -> None:
    """What ``mlflow.start_span`` records for an exception (an ``exception`` event and an ERROR
    status), with the message and traceback redacted."""
    entities = _import_mlflow("mlflow.entities")

    stacktrace = "".join(traceback.format_exception(exc)).strip()
    live.add_event(entities.SpanEvent(name="exception", attributes={
        "exception.message": redact_text(str(exc), known),
        "exception.type": type(exc).__name__,
        "exception.stacktrace": redact_text(stacktrace, known),
    }))
    live.set_status(entities.SpanStatus(entities.SpanStatusCode.ERROR, description=description))


class MLflowTracer(Tracer):
    """Records spans with MLflow tracing.

    A span opened with no enclosing span starts a new MLflow trace (the rollout worker opens
    one ``agent_loop`` span per sample, so each sample is one trace and its ``generate`` and
    tool spans nest under it). Tags from :func:`~agentloop_core.tracing.trace_context`
    (``step``, ``sample_index``, ``rollout_n``) and the span's attributes (secrets redacted)
    are stored as span attributes.

    MLflow's tracking URI is process-global, so one process should trace to one store.

    Args:
        tracking_uri: Where traces go, e.g. ``sqlite:////abs/path/mlflow.db``.
        experiment: Experiment name; created when missing.
        artifact_location: Artifact folder for a newly created experiment. Default: an
            ``mlflow-artifacts`` folder next to a sqlite database, else a temp folder, so
            nothing lands in ``./mlruns``.

    Raises:
        ImportError: when mlflow is not installed, with the pip command to fix it.
    """

    def __init__(
        self,
        tracking_uri: str,
        experiment: str = "agentloop-rollouts",
        artifact_location: str | None = None,
    ) -> None:
        mlflow = _import_mlflow()
        trace_location = _import_mlflow("mlflow.entities.trace_location")

        self.tracking_uri = tracking_uri
        self.experiment = experiment
        if artifact_location is None:
            if tracking_uri.startswith("sqlite:///"):
                artifact_location = str(Path(tracking_uri[len("sqlite:///") :]).parent / "mlflow-artifacts")
            else:
                artifact_location = tempfile.mkdtemp(prefix="agentloop-mlflow-")
        self.artifact_location = artifact_location
        mlflow.set_tracking_uri(tracking_uri)
        found = mlflow.get_experiment_by_name(experiment)
        if found is not None:
            self.experiment_id = found.experiment_id
        else:
            self.experiment_id = mlflow.create_experiment(
                experiment, artifact_location=Path(artifact_location).resolve().as_uri()
            )
        self._mlflow = mlflow
        self._location = trace_location.MlflowExperimentLocation(experiment_id=self.experiment_id)

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.tracking_uri, self.experiment, self.artifact_location))

    @contextmanager
    def span(self, name: str, **attributes: Any) -> Iterator[dict[str, Any]]:
        """Open an MLflow span; attributes put into the yielded dict are stored at the end."""
        mlflow = self._mlflow
        record: dict[str, Any] = {**current_tags(), **attributes}
        root = mlflow.get_current_active_span() is None
        kwargs: dict[str, Any] = {"trace_destination": self._location} if root else {}
        error: BaseException | None = None
        with span_secrets(record), mlflow.start_span(name, **kwargs) as live:
            try:
                yield record
            except BaseException as exc:
                # Caught here and raised again below, outside start_span: MLflow would record the
                # raw message and traceback (an exception event and the status description).
                record["error"] = error_text(exc)
                error = exc
            finally:
                redacted = redact_span(record)
                live.set_attributes(_attr(redacted))
                if error is not None:
                    _record_error(live, error, redacted["error"], span_known_secrets(record))
        if error is not None:
            raise error

    def flush(self) -> None:
        """Wait until queued traces are written to the store."""
        flush = getattr(self._mlflow, "flush_trace_async_logging", None)
        if flush is not None:
            flush()

    def search(self, max_results: int | None = None) -> list[Any]:
        """Read back this experiment's traces (``mlflow.entities.Trace``), newest first."""
        self.flush()
        return self._mlflow.search_traces(
            locations=[self.experiment_id], max_results=max_results, return_type="list"
        )
