"""A multi-step environment with state: guess a secret number, told "higher" or "lower" after
each guess (registered as ``number_guess`` in the ``agentloop.environments`` entry points).

Rewards per step: 1.0 for the right guess (the episode ends), -0.1 for a guess that wastes a
turn (outside the range the feedback so far allows, or no number at all), 0 otherwise. The
trajectory's reward is their sum, so the best episode scores 1.0.
"""

from __future__ import annotations

import random
import re
from collections.abc import Mapping, Sequence
from typing import Any

from agentloop_core.environment import AssistantTurn, Environment, StepResult, register_environment

__all__ = ["DATA_SOURCE", "NumberGuessEnv", "number_guess_rows"]

DATA_SOURCE = "agentloop/number_guess"
"""Rows' ``data_source``; no built-in scorer has it, so ``reward.source=auto`` keeps the loop's reward."""
WASTED_GUESS = -0.1
"""Reward of a guess that cannot be right given the feedback so far (or that is not a number)."""
_NUMBER = re.compile(r"-?\d+")


@register_environment("number_guess")
class NumberGuessEnv(Environment):
    """Guess the row's secret in ``[low, high]`` within ``max_guesses`` turns.

    The secret is the row's ``extra_info.secret`` (else its ground truth); the guess is the last
    integer in the turn's content (reasoning excluded when a reasoning parser is set).

    Args:
        max_guesses: Turns before the episode ends unsolved.
    """

    def __init__(self, max_guesses: int = 6) -> None:
        if isinstance(max_guesses, bool) or not isinstance(max_guesses, int) or max_guesses < 1:
            raise ValueError(f"number_guess max_guesses must be a positive integer, got {max_guesses!r}")
        self.max_guesses = max_guesses
        self.secret = 0
        self.low = self.high = 0
        self.guesses = 0

    async def reset(self, row: Mapping[str, Any]) -> Sequence[Mapping[str, Any]]:
        extra = row.get("extra_info") or {}
        secret = extra.get("secret", row.get("ground_truth"))
        if secret is None:
            raise ValueError("number_guess needs the secret in the row's extra_info.secret (or its ground truth)")
        self.secret = int(secret)
        self.low, self.high = int(extra.get("low", 1)), int(extra.get("high", 100))
        if not self.low <= self.secret <= self.high:
            raise ValueError(f"number_guess secret {self.secret} is outside [{self.low}, {self.high}]")
        return await super().reset(row)

    async def step(self, turn: AssistantTurn) -> StepResult:
        self.guesses += 1
        numbers = _NUMBER.findall(turn.content)
        out_of_turns = self.guesses >= self.max_guesses
        if not numbers:
            info = {"invalid": 1, "solved": 0}
            return StepResult([_user(f"Reply with one whole number from {self.low} to {self.high}.")],
                              WASTED_GUESS, out_of_turns, info)
        guess = int(numbers[-1])
        if guess == self.secret:
            return StepResult([], 1.0, True, {"solved": 1, "guesses": self.guesses})
        wasted = not self.low <= guess <= self.high
        if guess < self.secret:
            self.low = max(self.low, guess + 1)
            hint = "Higher."
        else:
            self.high = min(self.high, guess - 1)
            hint = "Lower."
        return StepResult([_user(hint)], WASTED_GUESS if wasted else 0.0, out_of_turns,
                          {"solved": 0, "wasted": int(wasted)})


def _user(text: str) -> dict[str, str]:
    return {"role": "user", "content": text}


def number_guess_rows(n: int, seed: int, split: str, low: int = 1, high: int = 100) -> list[dict[str, Any]]:
    """``n`` dataset rows of the game (``agent_name: env_agent``), secrets drawn from ``seed``."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        secret = rng.randint(low, high)
        prompt = [{"role": "system", "content": f"Guess the number from {low} to {high}. Reply with one number."},
                  {"role": "user", "content": "Your guess?"}]
        rows.append({"data_source": DATA_SOURCE, "agent_name": "env_agent", "prompt": prompt,
                     "reward_model": {"style": "rule", "ground_truth": str(secret)},
                     "extra_info": {"split": split, "index": i, "environment": "number_guess",
                                    "secret": secret, "low": low, "high": high}})
    return rows
