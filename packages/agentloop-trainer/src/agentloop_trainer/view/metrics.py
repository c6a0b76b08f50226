"""Metrics sinks (JSONL always, MLflow when asked) and the reward-curve plot."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

_MLFLOW_HINT = 'MLflow metrics need mlflow: pip install "agentloop-trainer[mlflow]"'


class MetricsLogger:
    """Appends one JSON object per record to ``path``; mirrors numeric values to MLflow.

    Args:
        path: The JSONL file.
        mlflow_uri: Tracking URI (e.g. ``sqlite:///mlflow.db``); None: no MLflow.
        run_name: MLflow run name.

    Raises:
        ImportError: ``mlflow_uri`` is set but mlflow is not installed.
    """

    def __init__(self, path: str | Path, mlflow_uri: str | None = None, run_name: str | None = None) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("a")
        self._mlflow = None
        if mlflow_uri:
            import os

            os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
            try:
                import mlflow
            except ImportError as exc:
                raise ImportError(_MLFLOW_HINT) from exc
            mlflow.set_tracking_uri(mlflow_uri)
            experiment = "agentloop"
            if mlflow.get_experiment_by_name(experiment) is None:
                mlflow.create_experiment(experiment, artifact_location=str(self.path.parent / "mlruns"))
            mlflow.set_experiment(experiment)
            mlflow.start_run(run_name=run_name)
            self._mlflow = mlflow

    def log(self, metrics: dict[str, Any], step: int) -> None:
        """Write one record."""
        self._file.write(json.dumps({"step": step, **{k: v for k, v in metrics.items() if k != "step"}}) + "\n")
        self._file.flush()
        if self._mlflow is not None:
            numeric = {k.replace("/", "_"): float(v) for k, v in metrics.items()
                       if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(float(v)) and k != "step"}
            self._mlflow.log_metrics(numeric, step=step)

    def close(self) -> None:
        """Flush and close."""
        self._file.close()
        if self._mlflow is not None:
            self._mlflow.end_run()
            self._mlflow = None


def plot_reward_curve(history: Sequence[dict[str, Any]], path: str | Path, title: str = "agentloop GRPO") -> Path:
    """Plot training reward per step and held-out accuracy at each evaluation.

    Returns:
        The PNG path.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [(h["step"], h["reward/mean"]) for h in history if "reward/mean" in h]
    evals = [(h["step"], h["eval/accuracy"]) for h in history if "eval/accuracy" in h]
    fig, ax = plt.subplots(figsize=(7, 4))
    if train:
        ax.plot(*zip(*train, strict=True), label="train reward (mean over group samples)", color="tab:blue", alpha=0.7)
    if evals:
        ax.plot(*zip(*evals, strict=True), "o-", label="held-out accuracy (greedy)", color="tab:red")
    ax.set_xlabel("GRPO step")
    ax.set_ylabel("reward / accuracy")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    ax.set_title(title)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def idle_fraction(busy_s: float, wall_s: float) -> float:
    """One minus the share of ``wall_s`` during which the engine had a call in flight (the
    ``rollout/engine_idle_fraction`` of a step)."""
    return 1.0 - min(1.0, busy_s / max(wall_s, 1e-9))
