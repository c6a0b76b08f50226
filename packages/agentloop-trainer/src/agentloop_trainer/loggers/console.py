"""``trainer.logger=console``: one line per training step on the console."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from agentloop_trainer.loggers.base import Logger
from agentloop_trainer.loggers.settings import LoggingSection


class ConsoleLogger(Logger):
    """Prints a training step's reward, losses, signal and timings (evaluation records are
    printed by the trainer itself, as are run notices)."""

    name = "console"

    def __init__(self, log: Callable[[str], None] = print) -> None:
        self.log = log

    @classmethod
    def from_config(cls, settings: LoggingSection, run_dir: Path, log: Callable[[str], None],
                    run_config: Mapping[str, Any]) -> ConsoleLogger:
        return cls(log)

    def log_metrics(self, metrics: Mapping[str, Any], step: int) -> None:
        if "reward/mean" in metrics:
            self.log(console_line(metrics))


def console_line(m: Mapping[str, Any]) -> str:
    """``step   3 | reward 0.625 | pg_loss -0.0123 | ...`` for a training step's record."""
    parts = [f"step {m['step']:>3}", f"reward {m['reward/mean']:.3f}", f"pg_loss {m.get('actor/pg_loss', 0.0):+.4f}",
             f"grad {m.get('actor/grad_norm', 0.0):.3f}", f"signal {m.get('rollout/groups_with_signal', 0.0):.2f}",
             f"gen {m.get('timing_s/generate', 0.0):.1f}s", f"upd {m.get('timing_s/update', 0.0):.1f}s"]
    if "eval/accuracy" in m:
        parts.append(f"eval {m['eval/accuracy']:.3f}")
    return " | ".join(parts)
