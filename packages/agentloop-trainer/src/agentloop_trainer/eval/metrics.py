"""Sampled-evaluation metrics over problems: unbiased pass@k, avg@k and maj@k, each with the
standard error of its mean over problems.

Every metric is a mean over problems of a per-problem score, so one standard error serves them
all: the analytic SE of a mean, ``std(scores, ddof=1) / sqrt(problems)`` (the CLT error bar of
Miller, "Adding Error Bars to Evals", 2024). It measures how much the number would move on
another draw of problems of the same kind *and* of samples (each problem's score already
carries its own sampling noise); it is not a bootstrap, and it is undefined (None) for a single
problem.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

CORRECT_AT = 1.0
"""A sample is correct when its reward is at least this: the built-in scorers give 1.0 for a
right answer and 0.0 otherwise (a partial or format reward below 1 does not pass)."""


@dataclass(frozen=True)
class ProblemSamples:
    """The ``n`` samples of one problem, in ``rollout_n`` order."""

    rewards: tuple[float, ...]
    """Each sample's reward (0 for a failed sample: failures count, they are not dropped)."""
    answers: tuple[str | None, ...] | None = None
    """Each sample's extracted answer (None where it gave none or failed); None as a whole when
    the scorer exposes no answer extraction (then maj@k is not computed)."""

    def __post_init__(self) -> None:
        if not self.rewards:
            raise ValueError("a problem needs at least one sample")
        if self.answers is not None and len(self.answers) != len(self.rewards):
            raise ValueError(f"{len(self.answers)} answers for {len(self.rewards)} samples")

    @property
    def n(self) -> int:
        """Samples drawn."""
        return len(self.rewards)

    @property
    def correct(self) -> int:
        """Samples whose reward reaches :data:`CORRECT_AT`."""
        return sum(r >= CORRECT_AT for r in self.rewards)


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one problem with ``c`` correct of ``n`` samples (Chen et al. 2021,
    "Evaluating Large Language Models Trained on Code"): ``1 - C(n-c, k) / C(n, k)``, the chance
    that ``k`` samples drawn without replacement hold a correct one, computed as the stable
    product ``1 - prod_{i=n-c+1}^{n} (1 - k/i)`` (binomials of n=200 overflow floats).

    Raises:
        ValueError: ``k`` outside ``1..n`` (pass@k needs at least k samples: raise
            ``val_kwargs.n``), or ``c`` outside ``0..n``.
    """
    if n < 1:
        raise ValueError(f"pass@k needs at least one sample, got n={n}")
    if not 0 <= c <= n:
        raise ValueError(f"correct samples c={c} must be within 0..n={n}")
    if not 1 <= k <= n:
        raise ValueError(f"pass@{k} needs at least {k} samples per problem but there are n={n}; "
                         f"raise actor_rollout_ref.rollout.val_kwargs.n to {k} or more, or ask for k <= {n}")
    if n - c < k:
        return 1.0
    prod = 1.0
    for i in range(n - c + 1, n + 1):
        prod *= 1.0 - k / i
    return 1.0 - prod


def majority_answer(answers: Sequence[str | None]) -> int | None:
    """Index of the sample whose answer wins the vote (None answers do not vote): the most
    frequent answer, a tie going to the answer given first; None when no sample answered."""
    counts: dict[str, int] = {}
    first: dict[str, int] = {}
    for i, a in enumerate(answers):
        if a is None:
            continue
        counts[a] = counts.get(a, 0) + 1
        first.setdefault(a, i)
    if not counts:
        return None
    best = max(counts, key=lambda a: (counts[a], -first[a]))
    return first[best]


def maj_at_k(problem: ProblemSamples, k: int) -> float:
    """1.0 when the majority answer of the first ``k`` samples is correct (its first sample's
    reward reaches :data:`CORRECT_AT`), else 0.0; a problem with no answer at all scores 0.

    Raises:
        ValueError: ``k`` outside ``1..n``, or the scorer extracts no answers.
    """
    if problem.answers is None:
        raise ValueError("maj@k needs the extracted answers, and this scorer exposes none")
    if not 1 <= k <= problem.n:
        raise ValueError(f"maj@{k} needs at least {k} samples per problem but there are n={problem.n}")
    winner = majority_answer(problem.answers[:k])
    return 0.0 if winner is None else float(problem.rewards[winner] >= CORRECT_AT)


@dataclass(frozen=True)
class Estimate:
    """A mean over problems with its standard error."""

    mean: float
    """The mean of the per-problem scores."""
    se: float | None
    """Analytic standard error of the mean (None for fewer than two problems)."""

    def __str__(self) -> str:
        return f"{self.mean:.3f}" + ("" if self.se is None else f" ± {self.se:.3f}")


def mean_and_se(scores: Sequence[float]) -> Estimate:
    """The mean of per-problem ``scores`` and its analytic standard error.

    Raises:
        ValueError: no scores.
    """
    m = len(scores)
    if m == 0:
        raise ValueError("no problems to average over")
    mean = math.fsum(scores) / m
    if m < 2:
        return Estimate(mean, None)
    var = math.fsum((s - mean) ** 2 for s in scores) / (m - 1)
    return Estimate(mean, math.sqrt(var / m))


def default_ks(n: int) -> list[int]:
    """The k reported for ``n`` samples: 1, the powers of two below ``n``, and ``n``."""
    ks, k = [], 1
    while k < n:
        ks.append(k)
        k *= 2
    return [*ks, n]


def set_metrics(problems: Sequence[ProblemSamples], ks: Sequence[int] | None = None) -> dict[str, Estimate]:
    """pass@k for each ``k`` (default :func:`default_ks` of the smallest ``n``), ``avg@n`` (the
    mean reward: the accuracy for 0/1 rewards) and, when every problem has extracted answers,
    ``maj@n``; ``n`` is the samples per problem (the smallest, when they differ).

    Raises:
        ValueError: no problems, or a ``k`` above ``n``.
    """
    if not problems:
        raise ValueError("no problems to evaluate")
    n = min(p.n for p in problems)
    out = {f"pass@{k}": mean_and_se([pass_at_k(p.n, p.correct, k) for p in problems])
           for k in (ks if ks is not None else default_ks(n))}
    out[f"avg@{n}"] = mean_and_se([math.fsum(p.rewards[:n]) / n for p in problems])
    if all(p.answers is not None for p in problems):
        out[f"maj@{n}"] = mean_and_se([maj_at_k(p, n) for p in problems])
    return out
