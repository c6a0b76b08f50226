"""``metrics.jsonl``: every record as one JSON line, always written (the viewer, the tests and
anyone's scripts read it), whether or not ``trainer.logger`` lists ``jsonl``."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from agentloop_trainer.loggers.base import Logger
from agentloop_trainer.loggers.settings import LoggingSection

METRICS_FILE = "metrics.jsonl"
"""The file in the run folder."""


class JsonlLogger(Logger):
    """Appends ``{"step": N, ...}`` per record to ``path`` and flushes it (a crashed run keeps
    what it logged).

    Args:
        path: The JSONL file (its folder is made).
    """

    name = "jsonl"

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("a")

    @classmethod
    def from_config(cls, settings: LoggingSection, run_dir: Path, log: Callable[[str], None],
                    run_config: Mapping[str, Any]) -> JsonlLogger:
        return cls(run_dir / METRICS_FILE)

    def log_metrics(self, metrics: Mapping[str, Any], step: int) -> None:
        self._file.write(json.dumps({"step": step, **{k: v for k, v in metrics.items() if k != "step"}}) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()
