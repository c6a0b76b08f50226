"""``trainer.logger=mlflow``: metrics, each step's trajectories (JSON) and the reward-curve plot
in an MLflow run."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from agentloop_trainer.loggers.base import Logger, scalar_metrics
from agentloop_trainer.loggers.settings import LoggingSection


def mlflow_uri(settings: LoggingSection, run_dir: Path) -> str:
    """``trainer.mlflow_tracking_uri``, else ``$MLFLOW_TRACKING_URI``, else a SQLite file in the
    run folder (``sqlite:///<run>/mlflow.db``)."""
    return (settings.mlflow_tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
            or f"sqlite:///{(run_dir / 'mlflow.db').resolve()}")


class MlflowLogger(Logger):
    """One MLflow run in the experiment ``project`` (made with its artifacts in
    ``<run>/mlruns`` when it does not exist). Metric names have ``/`` as ``_``
    and ``@`` as ``_at_`` (``reward_mean``, ``val_openai_gsm8k_pass_at_4``); a step's trajectories are the artifact ``trajectories/step_<N>.json``.

    Args:
        uri: The tracking URI (``sqlite:///mlflow.db``, ``http://...``).
        project: The experiment name.
        run_name: The run's name.
        artifact_root: Where a new experiment keeps its artifacts.
    """

    name = "mlflow"
    requires = ("mlflow", "mlflow")

    def __init__(self, uri: str, project: str, run_name: str, artifact_root: Path) -> None:
        os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
        import mlflow

        mlflow.set_tracking_uri(uri)
        if mlflow.get_experiment_by_name(project) is None:
            mlflow.create_experiment(project, artifact_location=str(artifact_root))
        mlflow.set_experiment(project)
        mlflow.start_run(run_name=run_name)
        self._mlflow: Any = mlflow

    @classmethod
    def from_config(cls, settings: LoggingSection, run_dir: Path, log: Callable[[str], None],
                    run_config: Mapping[str, Any]) -> MlflowLogger:
        uri = mlflow_uri(settings, run_dir)
        log(f"MLflow: run {run_dir.name} in experiment {settings.project_name} at {uri}")
        return cls(uri, settings.project_name, run_dir.name, run_dir / "mlruns")

    def log_metrics(self, metrics: Mapping[str, Any], step: int) -> None:
        if self._mlflow is not None:
            # MLflow refuses "@" in a name (val/<set>/pass@4): it becomes "_at_".
            self._mlflow.log_metrics({k.replace("/", "_").replace("@", "_at_"): v
                                      for k, v in scalar_metrics(metrics).items()}, step=step)

    def log_trajectories(self, rows: Sequence[Mapping[str, Any]], step: int) -> None:
        if self._mlflow is not None:
            self._mlflow.log_dict([dict(r) for r in rows], f"trajectories/step_{step}.json")

    def log_artifact(self, path: Path) -> None:
        if self._mlflow is not None:
            self._mlflow.log_artifact(str(path))

    def close(self) -> None:
        if self._mlflow is not None:
            self._mlflow.end_run()
            self._mlflow = None
