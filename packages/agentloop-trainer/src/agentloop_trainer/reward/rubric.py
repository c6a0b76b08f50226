"""A judge's rubric (``reward.judge.rubric``): named criteria, each with a description and a
weight; the judge scores every criterion and the reward is their weighted mean.

The names follow verifiers' ``Rubric`` (reward functions with weights) and ART's RULER
(a free-text rubric handed to the judge): here a criterion is a name the judge's JSON reply
keys its score by, a description the judge reads, and a weight. Each criterion's score is
mapped by ``score_range`` onto [0, 1] first, so the weighted mean stays in [0, 1] whatever the
weights (``sum(w_i * s_i) / sum(w_i)``); with ``score_range: null`` it is the weighted mean of
the raw scores. Each criterion's (mapped) score is a per-sample metric ``judge/<name>``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
"""What a criterion's name may be: a JSON key and a metric name without quoting."""
RESERVED = ("calls", "failed_calls", "prompt_tokens", "completion_tokens", "seconds", "failures")
"""Names taken by the judge's cost metrics (``judge/<key>``), so no criterion may have them
(the same keys as :data:`agentloop_trainer.reward.judge_client.COST_KEYS`)."""


@dataclass(frozen=True)
class Criterion:
    """One rubric criterion."""

    name: str
    """The key the judge scores it under, and the metric ``judge/<name>``."""
    description: str
    """What the judge reads about it."""
    weight: float = 1.0
    """Its share of the reward (> 0), relative to the other criteria's weights."""


def check_rubric(entries: Sequence[Any] | None, where: str = "reward.judge.rubric") -> tuple[Criterion, ...]:
    """The criteria of a ``reward.judge.rubric`` list (``{name, description, weight}`` each);
    ``()`` for None (no rubric).

    Raises:
        ValueError: naming ``where`` and the entry: an empty list, a name that is missing, not
            an identifier, repeated or reserved, an empty description, a weight not > 0.
    """
    if entries is None:
        return ()
    if len(entries) == 0:
        raise ValueError(f"{where} is empty: give at least one {{name, description, weight}} criterion, or null "
                         "for a single score")
    out: list[Criterion] = []
    for i, entry in enumerate(entries):
        at = f"{where}[{i}]"
        if not isinstance(entry, Mapping):
            raise ValueError(f"{at} must be a mapping {{name, description, weight}}, got {entry!r:.200}")
        name, description, weight = entry.get("name"), entry.get("description"), entry.get("weight", 1.0)
        if not isinstance(name, str) or not NAME.match(name):
            raise ValueError(f"{at}.name must be an identifier (letters, digits, _; the judge's JSON key and the "
                             f"metric judge/<name>), got {name!r}")
        if name in RESERVED:
            raise ValueError(f"{at}.name {name!r} is taken by the judge's cost metric judge/{name}; rename it "
                             f"(reserved: {list(RESERVED)})")
        if any(c.name == name for c in out):
            raise ValueError(f"{at}.name {name!r} is used twice; each criterion needs its own name")
        if not isinstance(description, str) or not description.strip():
            raise ValueError(f"{at}.description must say what the judge scores under {name!r}, got {description!r}")
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight) or weight <= 0:
            raise ValueError(f"{at}.weight must be a finite number > 0 (its share of the reward), got {weight!r}; "
                             "drop the criterion instead of weighting it 0")
        out.append(Criterion(name=name, description=description.strip(), weight=float(weight)))
    return tuple(out)


def criteria_text(rubric: Sequence[Criterion]) -> str:
    """The ``{criteria}`` of a prompt: one ``- name: description`` line per criterion."""
    return "\n".join(f"- {c.name}: {c.description}" for c in rubric)


def _number(raw: Any, what: str) -> float:
    if isinstance(raw, bool) or not isinstance(raw, (int, float, str)):
        raise ValueError(f"{what} {raw!r} is not a number")
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{what} {raw!r} is not a number") from None
    if not math.isfinite(value):
        raise ValueError(f"{what} {raw!r} is not finite")
    return value


def map_score(raw: Any, score_range: Sequence[float] | None, what: str = "the score") -> float:
    """``raw`` as a number mapped by ``score_range`` onto [0, 1] (None: as it is).

    Raises:
        ValueError: not a finite number, or outside the range.
    """
    score = _number(raw, what)
    if score_range is None:
        return score
    low, high = score_range
    if not low <= score <= high:
        raise ValueError(f"{what} {score:g} is outside reward.judge.score_range [{low:g}, {high:g}]")
    return (score - low) / (high - low)


def rubric_score(scores: Any, rubric: Sequence[Criterion],
                 score_range: Sequence[float] | None) -> tuple[float, dict[str, float]]:
    """``(weighted mean, {name: mapped score})`` of one answer's criterion scores: ``scores``
    maps each criterion's name to its score (extra keys, such as an explanation, are ignored).

    Raises:
        ValueError: ``scores`` is not a mapping, lacks a criterion, or a score is not a number
            in the range.
    """
    if not isinstance(scores, Mapping):
        raise ValueError(f"expected an object of criterion scores {{{', '.join(c.name for c in rubric)}}}, "
                         f"got {scores!r:.200}")
    missing = [c.name for c in rubric if c.name not in scores]
    if missing:
        raise ValueError(f"no score for criteria {missing} (got keys {sorted(map(str, scores))})")
    parts = {c.name: map_score(scores[c.name], score_range, f"criterion {c.name!r}'s score") for c in rubric}
    total = math.fsum(c.weight for c in rubric)
    return math.fsum(c.weight * parts[c.name] for c in rubric) / total, parts
