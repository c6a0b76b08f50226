"""What a metrics backend implements, and the shapes every backend shares (scalars, trajectory rows)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    from collections.abc import Callable

    from agentloop_trainer.loggers.settings import LoggingSection


class Logger:
    """One place the trainer's records go (``trainer.logger`` names them).

    A backend is a subclass registered in :data:`agentloop_trainer.loggers.LOGGERS`: it builds
    itself from the config (:meth:`from_config`) and receives every record the run writes to
    ``metrics.jsonl`` (:meth:`log_metrics`), each step's sample trajectories
    (:meth:`log_trajectories`) and the run's files at the end (:meth:`log_artifact`). Only
    :meth:`log_metrics` is required.
    """

    name: ClassVar[str]
    """The name in ``trainer.logger``."""
    requires: ClassVar[tuple[str, str] | None] = None
    """(module to import, the trainer's extra that installs it); None: nothing beyond the trainer."""

    @classmethod
    def from_config(cls, settings: LoggingSection, run_dir: Path, log: Callable[[str], None],
                    run_config: Mapping[str, Any]) -> Logger:
        """The backend for a run.

        Args:
            settings: The loggers' keys (the config's ``trainer`` section).
            run_dir: The run folder.
            log: The console printer (notices such as where the files go).
            run_config: The whole config as a plain dict (W&B records it with the run).
        """
        raise NotImplementedError

    def log_metrics(self, metrics: Mapping[str, Any], step: int) -> None:
        """One record: a training step's metrics, or an evaluation's."""
        raise NotImplementedError

    def log_trajectories(self, rows: Sequence[Mapping[str, Any]], step: int) -> None:
        """A step's sample trajectories (:func:`trajectory_rows`), logged before that step's metrics."""

    def log_artifact(self, path: Path) -> None:
        """A file the run wrote (the reward-curve plot)."""

    def close(self) -> None:
        """Flush and end the run; nothing of the backend outlives it."""


def scalar_metrics(metrics: Mapping[str, Any]) -> dict[str, float]:
    """The finite numbers of a record (booleans, strings, NaN and ``step`` left out): what a
    scalar chart can plot."""
    return {k: float(v) for k, v in metrics.items()
            if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(float(v))}


TRAJECTORY_COLUMNS: tuple[str, ...] = (
    "step", "trajectory_index", "segment_index", "group_id", "data_source", "reward", "advantage", "failed",
    "num_turns", "prompt", "response", "ground_truth",
)
"""Columns of a trajectory row (a W&B table's, MLflow's JSON keys)."""


def trajectory_rows(records: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """One row per record of ``trajectories/step_<N>.jsonl``
    (:func:`~agentloop_trainer.view.viewer.trajectory_records`): its numbers and the text of its
    prompt and response, joined from the decoded tokens the engine generated (display only)."""
    def text(tokens: Any) -> str:
        return "".join(t for t in tokens if isinstance(t, str)) if isinstance(tokens, list) else ""

    rows = []
    for r in records:
        truth = r.get("ground_truth")
        rows.append({
            "step": int(r.get("step") or 0), "trajectory_index": int(r.get("trajectory_index") or 0),
            "segment_index": int(r.get("segment_index") or 0), "group_id": str(r.get("group_id") or ""),
            "data_source": str(r.get("data_source") or ""), "reward": float(r.get("reward") or 0.0),
            "advantage": None if r.get("advantage") is None else float(r["advantage"]),
            "failed": bool(r.get("failed")), "num_turns": int(r.get("num_turns") or 0),
            "prompt": text(r.get("prompt_tokens")), "response": text(r.get("response_tokens")),
            "ground_truth": "" if truth is None else str(truth),
        })
    return rows
