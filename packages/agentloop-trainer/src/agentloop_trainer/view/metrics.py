"""A metrics file for scripts (JSONL, MLflow when asked) and the reward-curve plot."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any


class MetricsLogger:
    """Appends one JSON object per record to ``path``; mirrors numeric values to MLflow.

    The trainer's own runs go through :class:`~agentloop_trainer.loggers.Tracking`
    (``trainer.logger``); this is the same JSONL and MLflow backends for a script of one's own.

    Args:
        path: The JSONL file.
        mlflow_uri: Tracking URI (e.g. ``sqlite:///mlflow.db``); None: no MLflow.
        run_name: MLflow run name.

    Raises:
        ImportError: ``mlflow_uri`` is set but mlflow is not installed.
    """

    def __init__(self, path: str | Path, mlflow_uri: str | None = None, run_name: str | None = None) -> None:
        from agentloop_trainer.loggers import JsonlLogger, Logger, MlflowLogger, Tracking, missing_package

        self.path = Path(path)
        loggers: list[Logger] = [JsonlLogger(self.path)]
        if mlflow_uri:
            hint = missing_package("mlflow")
            if hint:
                raise ImportError(f"MLflow metrics need mlflow: {hint}")
            loggers.append(MlflowLogger(mlflow_uri, "agentloop", run_name or self.path.parent.name,
                                        self.path.parent / "mlruns"))
        self._tracking = Tracking(loggers)

    def log(self, metrics: dict[str, Any], step: int) -> None:
        """Write one record."""
        self._tracking.log(metrics, step)

    def close(self) -> None:
        """Flush and close."""
        self._tracking.close()


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
