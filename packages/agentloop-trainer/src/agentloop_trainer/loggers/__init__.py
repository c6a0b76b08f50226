"""Where the trainer's metrics go: ``trainer.logger`` as verl spells it
(``[console,jsonl,mlflow,wandb,tensorboard]``), one backend class per name.

Adding a backend is a :class:`~agentloop_trainer.loggers.base.Logger` subclass and a line in
:data:`LOGGERS`; the training loop only talks to :class:`Tracking`. ``metrics.jsonl`` is always
written (the viewer, resumed runs' readers and the tests read it), listed or not, and
``trainer.mlflow_tracking_uri`` turns on ``mlflow`` as it did before ``trainer.logger`` existed.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from agentloop_trainer.config_base import ConfigError
from agentloop_trainer.loggers.base import TRAJECTORY_COLUMNS, Logger, scalar_metrics, trajectory_rows
from agentloop_trainer.loggers.console import ConsoleLogger, console_line
from agentloop_trainer.loggers.jsonl import METRICS_FILE, JsonlLogger
from agentloop_trainer.loggers.mlflow_logger import MlflowLogger
from agentloop_trainer.loggers.settings import LoggingSection
from agentloop_trainer.loggers.tensorboard_logger import TensorBoardLogger
from agentloop_trainer.loggers.wandb_logger import WANDB_MODES, WandbLogger, wandb_mode

LOGGERS: dict[str, type[Logger]] = {
    cls.name: cls for cls in (ConsoleLogger, JsonlLogger, MlflowLogger, WandbLogger, TensorBoardLogger)
}
"""``trainer.logger`` name -> backend class."""


def parse_logger_names(value: Any) -> list[str]:
    """verl's list (``[console,wandb]``), one name, or a comma string (``console,wandb``) as a list."""
    items = [value] if isinstance(value, str) else list(value or [])
    return [name.strip() for item in items for name in str(item).split(",") if name.strip()]


def active_loggers(settings: LoggingSection) -> list[str]:
    """The backends a run writes to, in order: ``jsonl`` always first, then ``trainer.logger``'s
    (duplicates dropped), and ``mlflow`` when ``trainer.mlflow_tracking_uri`` is set."""
    names = ["jsonl", *parse_logger_names(settings.logger)]
    if settings.mlflow_tracking_uri:
        names.append("mlflow")
    return list(dict.fromkeys(names))


def missing_package(name: str) -> str | None:
    """The ``pip install`` line a backend still needs, or None when it can be imported."""
    requires = LOGGERS[name].requires
    if requires is None:
        return None
    module, extra = requires
    try:
        found = importlib.util.find_spec(module) is not None
    except ValueError:  # a module set to None in sys.modules
        found = False
    return None if found else f"pip install 'agentloop-trainer[{extra}]'"


def check(settings: LoggingSection) -> None:
    """``trainer.logger``'s names and that their packages are installed, ``trainer.wandb_mode``.

    Raises:
        ConfigError: naming the key and the fix.
    """
    for name in parse_logger_names(settings.logger):
        if name not in LOGGERS:
            raise ConfigError(f"config trainer.logger: unknown logger {name!r}; the loggers are {', '.join(LOGGERS)} "
                             "(e.g. trainer.logger=[console,wandb])")
    for name in active_loggers(settings):
        hint = missing_package(name)
        if hint:
            why = "trainer.mlflow_tracking_uri is set" if name not in parse_logger_names(settings.logger) else (
                f"trainer.logger lists {name}")
            raise ConfigError(f"config {why}, but its package is not installed: {hint}")
    if settings.wandb_mode is not None and settings.wandb_mode not in WANDB_MODES:
        raise ConfigError(f"config trainer.wandb_mode must be null or one of {WANDB_MODES}, got {settings.wandb_mode!r}")


class Tracking:
    """Every active backend of a run, fed the same records (verl's name for it).

    Args:
        loggers: The backends, in the order they are called.
    """

    def __init__(self, loggers: Iterable[Logger]) -> None:
        self.loggers = list(loggers)

    @classmethod
    def from_config(cls, settings: LoggingSection, run_dir: str | Path, log: Callable[[str], None] = print,
                    run_config: Mapping[str, Any] | None = None) -> Tracking:
        """The backends :func:`active_loggers` names, built for ``run_dir``.

        Args:
            settings: The loggers' keys (the config's ``trainer`` section).
            run_dir: The run folder.
            log: The console printer.
            run_config: The whole config as a plain dict, for backends that record it (W&B).

        Raises:
            ImportError: a backend's package is missing (naming the extra to install).
        """
        run_dir = Path(run_dir)
        loggers: list[Logger] = []
        try:
            for name in active_loggers(settings):
                hint = missing_package(name)
                if hint:
                    raise ImportError(f"trainer.logger={name} needs its package: {hint}")
                loggers.append(LOGGERS[name].from_config(settings, run_dir, log, run_config or {}))
        except BaseException:
            cls(loggers).close()
            raise
        return cls(loggers)

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        """One record to every backend."""
        for logger in self.loggers:
            logger.log_metrics(metrics, step)

    def log_trajectories(self, records: Sequence[Mapping[str, Any]], step: int) -> None:
        """A step's trajectory records (as written to ``trajectories/step_<N>.jsonl``) to every backend."""
        if not records:
            return
        rows = trajectory_rows(records)
        for logger in self.loggers:
            logger.log_trajectories(rows, step)

    def log_artifact(self, path: str | Path) -> None:
        """A file of the run to every backend that keeps files."""
        for logger in self.loggers:
            logger.log_artifact(Path(path))

    def close(self) -> None:
        """Close every backend (all of them, even when one fails; the first error is raised)."""
        error: BaseException | None = None
        for logger in self.loggers:
            try:
                logger.close()
            except Exception as exc:  # noqa: BLE001 - the others still get closed
                error = error or exc
        self.loggers = []
        if error is not None:
            raise error


__all__ = [
    "LOGGERS", "METRICS_FILE", "TRAJECTORY_COLUMNS", "WANDB_MODES", "ConsoleLogger", "JsonlLogger", "Logger",
    "LoggingSection", "MlflowLogger", "TensorBoardLogger", "Tracking", "WandbLogger", "active_loggers", "console_line",
    "check", "missing_package", "parse_logger_names", "scalar_metrics", "trajectory_rows", "wandb_mode",
]
