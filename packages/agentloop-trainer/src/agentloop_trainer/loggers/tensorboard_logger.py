"""``trainer.logger=tensorboard``: scalars and each step's trajectories (text) as TensorBoard
event files, written by torch's ``SummaryWriter``."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from agentloop_trainer.loggers.base import Logger, scalar_metrics
from agentloop_trainer.loggers.settings import LoggingSection

_TEXT_CHARS = 4000  # of each prompt and response in the text panel; the full text is in trajectories/


class TensorBoardLogger(Logger):
    """Every number of a record as a scalar under its metric name (``reward/mean``...; the
    reward curve is ``reward/mean`` and ``eval/accuracy``), a step's trajectories as the text
    ``trajectories``. Events are flushed after each record, so ``tensorboard --logdir`` shows a
    live run.

    Args:
        log_dir: The event files' folder.
    """

    name = "tensorboard"
    requires = ("tensorboard", "tensorboard")

    def __init__(self, log_dir: str | Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = Path(log_dir)
        self._writer: Any = SummaryWriter(log_dir=str(self.log_dir))

    @classmethod
    def from_config(cls, settings: LoggingSection, run_dir: Path, log: Callable[[str], None],
                    run_config: Mapping[str, Any]) -> TensorBoardLogger:
        log_dir = Path(settings.tensorboard_dir) if settings.tensorboard_dir else run_dir / "tensorboard"
        log(f"TensorBoard: events in {log_dir} (tensorboard --logdir {log_dir})")
        return cls(log_dir)

    def log_metrics(self, metrics: Mapping[str, Any], step: int) -> None:
        if self._writer is None:
            return
        for key, value in scalar_metrics(metrics).items():
            self._writer.add_scalar(key, value, global_step=step)
        self._writer.flush()

    def log_trajectories(self, rows: Sequence[Mapping[str, Any]], step: int) -> None:
        if self._writer is None or not rows:
            return
        parts = []
        for r in rows:
            head = (f"**trajectory {r['trajectory_index']}** (segment {r['segment_index']}): reward {r['reward']:.3f}, "
                    f"{r['num_turns']} turns{', failed' if r['failed'] else ''}")
            body = "\n".join(f"    {line}" for line in (r["prompt"][-_TEXT_CHARS:] + r["response"][:_TEXT_CHARS]).splitlines())
            parts.append(f"{head}\n\n{body}")
        self._writer.add_text("trajectories", "\n\n".join(parts), global_step=step)

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
