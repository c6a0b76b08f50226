"""``trainer.logger=wandb``: a Weights & Biases run with the metrics, the config and each step's
trajectories as a table; offline (files only, no account) unless a key or a mode says otherwise."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from agentloop_trainer.loggers.base import TRAJECTORY_COLUMNS, Logger, scalar_metrics
from agentloop_trainer.loggers.settings import LoggingSection

WANDB_MODES = ("online", "offline", "disabled")
"""Values of ``trainer.wandb_mode`` (besides null)."""


def wandb_mode(configured: str | None) -> str:
    """``trainer.wandb_mode``, else ``$WANDB_MODE``, else online when ``$WANDB_API_KEY`` is set
    and offline when not (a run without an account still leaves its files to ``wandb sync``)."""
    if configured:
        return configured
    if os.environ.get("WANDB_MODE"):
        return os.environ["WANDB_MODE"]
    return "online" if os.environ.get("WANDB_API_KEY") else "offline"


class WandbLogger(Logger):
    """One W&B run: every number of a record under its metric name at ``step`` (the reward curve
    is ``reward/mean`` and ``eval/accuracy``), the run's config (secrets redacted), and a step's
    trajectories as the table ``trajectories`` (:data:`TRAJECTORY_COLUMNS`).

    W&B keeps one row per step and merges what is logged at the same step: the evaluation
    after the last step lands in that step's row.

    Args:
        project: The W&B project.
        run_name: The run's display name.
        directory: The folder W&B writes ``wandb/<mode>-run-<id>/`` into.
        mode: online, offline or disabled.
        config: The run's config as a plain mapping.
    """

    name = "wandb"
    requires = ("wandb", "wandb")

    def __init__(self, project: str, run_name: str, directory: str | Path, mode: str,
                 config: Mapping[str, Any] | None = None) -> None:
        import wandb

        Path(directory).mkdir(parents=True, exist_ok=True)
        self._wandb: Any = wandb
        self._tables: dict[int, dict[str, Any]] = {}
        self.run: Any = wandb.init(project=project, name=run_name, dir=str(directory), mode=mode,  # pyright: ignore[reportArgumentType]
                                   config=dict(config or {}))

    @classmethod
    def from_config(cls, settings: LoggingSection, run_dir: Path, log: Callable[[str], None],
                    run_config: Mapping[str, Any]) -> WandbLogger:
        from agentloop_core.tracing.redaction import redact

        mode = wandb_mode(settings.wandb_mode)
        directory = Path(settings.wandb_dir) if settings.wandb_dir else run_dir
        if mode == "offline":
            log(f"W&B: offline run in {directory / 'wandb'} (upload it with `wandb sync`; set WANDB_API_KEY "
                "or trainer.wandb_mode=online to log live)")
        return cls(settings.project_name, run_dir.name, directory, mode, redact(dict(run_config)))

    def log_metrics(self, metrics: Mapping[str, Any], step: int) -> None:
        if self.run is not None:
            self.run.log({**scalar_metrics(metrics), **self._tables.pop(step, {})}, step=step)

    def log_trajectories(self, rows: Sequence[Mapping[str, Any]], step: int) -> None:
        if self.run is None or not rows:
            return
        # Held for the step's metrics: one log call per step (a table logged ahead of its step
        # with commit=False landed in the previous step's row).
        self._tables[step] = {"trajectories": self._wandb.Table(
            columns=list(TRAJECTORY_COLUMNS), allow_mixed_types=True,
            data=[[r[c] for c in TRAJECTORY_COLUMNS] for r in rows])}

    def close(self) -> None:
        if self.run is None:
            return
        if self._tables:  # a step whose metrics never came (the run failed in between)
            for step, tables in sorted(self._tables.items()):
                self.run.log(tables, step=step)
            self._tables.clear()
        self.run.finish()
        self.run = None
        # finish() leaves wandb's service process running until the interpreter exits; stop it
        # unless another run of this process still uses it.
        if self._wandb.run is None:
            self._wandb.teardown()
