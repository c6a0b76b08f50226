"""The run's rollout tracer, from ``actor_rollout_ref.rollout.trace`` (verl's keys).

``backend=mlflow`` traces into the same MLflow store and experiment as the ``mlflow`` logger
(``trainer.mlflow_tracking_uri``, else ``$MLFLOW_TRACKING_URI``, else ``<run>/mlflow.db``);
``backend=jsonl`` appends spans to ``<run>/traces.jsonl``. ``max_samples_per_step_per_worker``
keeps whole GRPO groups: a prompt is traced with all its samples or not at all.
"""

from __future__ import annotations

import contextvars
from pathlib import Path
from typing import Any

from agentloop_core.tracing import NullTracer, Tracer, current_tags
from agentloop_trainer.loggers.mlflow_logger import mlflow_uri
from agentloop_trainer.loggers.settings import LoggingSection
from agentloop_trainer.rollout.settings import RolloutSection

__all__ = ["SampledTracer", "rollout_tracer"]

# Set inside the root span of a trajectory that is not traced, so its nested spans are not either.
_SKIPPED: contextvars.ContextVar[bool] = contextvars.ContextVar("agentloop_trace_skipped", default=False)
_NULL = NullTracer()


class _SkippedSpan:
    """The root span of an untraced trajectory: a dict to fill in, and nested spans skipped."""

    __slots__ = ("_token",)

    def __enter__(self) -> dict[str, Any]:
        self._token = _SKIPPED.set(True)
        return {}

    def __exit__(self, *exc_info: object) -> None:
        _SKIPPED.reset(self._token)


class SampledTracer(Tracer):
    """Passes spans to ``inner``, for at most ``max_prompts`` prompts per step.

    A prompt is its GRPO group: the ``n`` rows ``sample_index // n`` (``val_n`` in validation),
    as the trainer lays a batch out. The first prompts to start in a step are the ones traced.
    Each copy counts on its own: a Ray rollout worker gets its own copy (verl's "per worker");
    in process, the workers share one.

    Args:
        inner: The tracer that stores spans.
        token2text: :attr:`Tracer.token2text`.
        max_prompts: Prompts traced per step (training and validation each); None: all.
        n: Samples per training prompt.
        val_n: Samples per validation prompt.
    """

    def __init__(self, inner: Tracer, token2text: bool = False, max_prompts: int | None = None, n: int = 1,
                 val_n: int = 1) -> None:
        self.inner = inner
        self.token2text = token2text
        self.max_prompts = max_prompts
        self.n, self.val_n = max(1, n), max(1, val_n)
        self._chosen: dict[tuple[Any, bool], set[int]] = {}

    def span(self, name: str, **attributes: Any) -> Any:
        if _SKIPPED.get():
            return _NULL.span(name)
        if self.max_prompts is None or name != "agent_loop":
            return self.inner.span(name, **attributes)
        tags = current_tags()
        validate = bool(tags.get("validate"))
        prompt = int(tags.get("sample_index") or 0) // (self.val_n if validate else self.n)
        step = (tags.get("step"), validate)
        if step not in self._chosen:
            self._chosen = {k: v for k, v in self._chosen.items() if k[1] != validate}  # one step kept per kind
            self._chosen[step] = set()
        chosen = self._chosen[step]
        if prompt not in chosen and len(chosen) >= self.max_prompts:
            return _SkippedSpan()
        chosen.add(prompt)
        return self.inner.span(name, **attributes)

    def flush(self) -> None:
        self.inner.flush()

    def close(self) -> None:
        self.inner.close()


def rollout_tracer(rollout: RolloutSection, logging: LoggingSection, run_dir: str | Path) -> Tracer | None:
    """The tracer ``actor_rollout_ref.rollout.trace`` asks for, or None (``backend`` null);
    ``logging`` (the ``trainer`` section's logger keys) says where MLflow traces go.

    Raises:
        ImportError: ``backend=mlflow`` without mlflow installed (the config check says so first).
    """
    from agentloop_core.tracing import make_tracer

    trace = rollout.trace
    if trace.backend is None:
        return None
    run_dir = Path(run_dir)
    if trace.backend == "mlflow":
        inner = make_tracer({"backend": "mlflow", "tracking_uri": mlflow_uri(logging, run_dir),
                             "experiment": trace.project_name or logging.project_name,
                             "artifact_location": str(run_dir / "mlruns")})
    else:
        inner = make_tracer({"backend": trace.backend, "path": str(run_dir / "traces.jsonl")})
    r = rollout
    return SampledTracer(inner, token2text=trace.token2text, max_prompts=trace.max_samples_per_step_per_worker,
                         n=r.n, val_n=r.val_kwargs.n)
