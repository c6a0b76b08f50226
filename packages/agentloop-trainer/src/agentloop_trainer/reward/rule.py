"""Rule rewards: the final ``#### N`` answer against the ground truth (GSM8K style)."""

from __future__ import annotations

import re

_ANSWER = re.compile(r"####\s*(-?[\d,]*\.?\d+)")


def extract_answer(text: str) -> str | None:
    """The number after the last ``####`` in ``text`` (commas removed), or None."""
    matches = _ANSWER.findall(text)
    if not matches:
        return None
    return matches[-1].replace(",", "")


def _as_number(value: str) -> float | None:
    try:
        return float(value.replace(",", "").strip())
    except ValueError:
        return None


def answer_reward(solution_text: str, ground_truth: str | int | float) -> float:
    """1.0 when the last ``#### N`` in ``solution_text`` equals ``ground_truth``, else 0.0.

    Args:
        solution_text: What the model generated (its final turn, or all generated text).
        ground_truth: The expected number.

    Returns:
        The 0/1 reward.
    """
    predicted = extract_answer(solution_text)
    if predicted is None:
        return 0.0
    a, b = _as_number(predicted), _as_number(str(ground_truth))
    if a is None or b is None:
        return 0.0
    return 1.0 if abs(a - b) < 1e-6 else 0.0
