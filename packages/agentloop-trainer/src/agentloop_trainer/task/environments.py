"""The shipped environments and their dataset rows (``agentloop data env NAME``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from agentloop_trainer.task.calculator_env import CalculatorEnv, calculator_env_rows
from agentloop_trainer.task.number_guess import NumberGuessEnv, number_guess_rows

__all__ = ["ENVIRONMENT_ROWS", "CalculatorEnv", "NumberGuessEnv"]

ENVIRONMENT_ROWS: dict[str, Callable[[int, int, str], list[dict[str, Any]]]] = {
    "number_guess": number_guess_rows,
    "calculator": calculator_env_rows,
}
"""Environment name -> ``rows(n, seed, split)``."""
