"""The loggers' keys (``trainer.logger``, ``trainer.project_name`` and each backend's own
``trainer.*`` keys) as a section of their own (checked by :func:`agentloop_trainer.loggers.check`). The ``trainer`` section
extends it, so the keys keep verl's place in the YAML."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class LoggingSection:
    """Where metrics go: the ``trainer`` section's logger keys (verl: ``trainer.logger``)."""

    project_name: str = "agentloop"
    """Project: the MLflow experiment and the W&B project."""
    logger: list[str] = field(default_factory=lambda: ["console", "jsonl"])
    """Where metrics go (verl's key): any of console, jsonl, mlflow, wandb, tensorboard, as a
    list (``[console,wandb]``) or a comma string (``console,wandb``). ``metrics.jsonl`` is always
    written, listed or not (the viewer and scripts read it)."""
    mlflow_tracking_uri: str | None = None
    """MLflow's tracking URI (e.g. sqlite:///mlflow.db); setting it turns on the mlflow logger.
    null with ``mlflow`` in ``trainer.logger``: ``$MLFLOW_TRACKING_URI``, else
    ``sqlite:///<run>/mlflow.db``."""
    wandb_mode: str | None = None
    """online, offline or disabled; null: ``$WANDB_MODE``, else online when ``$WANDB_API_KEY`` is
    set and offline (files only, ``wandb sync`` uploads them) when not."""
    wandb_dir: str | None = None
    """Where W&B writes its ``wandb/`` folder; null: the run folder."""
    tensorboard_dir: str | None = None
    """TensorBoard event files' folder; null: ``<run>/tensorboard``."""
