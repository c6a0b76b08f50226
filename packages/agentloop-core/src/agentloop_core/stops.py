"""Why generation stopped early, counted where it is known: in the loop, at each ``generate``
call, from the engine's ``stop_reason`` and the budget the loop asked for. Never by decoding.

A ``generate`` call that returns ``stop_reason="length"`` used up the ``max_tokens`` it got,
and the loop knows which limit set that number:

* **turn cap**: the loop's per-turn ``max_tokens`` (the trainer's
  ``actor_rollout_ref.rollout.multi_turn.max_tokens_per_turn``), when it was the smaller;
* **response budget**: what was left of the trajectory's ``response_length``
  (``data.max_response_length``), when that was the smaller; a trajectory also runs into its
  budget when the next tool or user message no longer fits;
* **context**: the engine clamps ``max_tokens`` to ``max_model_len - len(prompt)``
  (:func:`agentloop_core.request_checks.validate_request`), so a ``length`` stop with fewer
  tokens than asked for hit the engine's context.

Loops report the counts in their output's ``metrics`` under the keys below;
:func:`agentloop_core.batch.batch_metrics` turns them into the batch's
``rollout/truncated/*`` fractions.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

TURNS = "stop/turns"
"""Per-sample metric: ``generate`` calls the loop made."""
TURN_CAP = "stop/turn_cap"
"""Per-sample metric: calls stopped by the per-turn token cap."""
CONTEXT = "stop/context"
"""Per-sample metric: calls stopped by the engine's context (``max_model_len``)."""
RESPONSE_BUDGET = "stop/response_budget"
"""Per-sample metric: 1 when the trajectory ran into its ``response_length``, else 0."""

STOP_METRICS = (TURNS, TURN_CAP, CONTEXT, RESPONSE_BUDGET)
"""Every per-sample key of this module."""


def length_stop_cause(stop_reason: str, num_tokens: int, requested: int, turn_cap: int | None) -> str | None:
    """Which limit stopped one ``generate`` call: ``"turn_cap"``, ``"response_budget"``,
    ``"context"``, or None when it did not stop on a limit (a stop token, an abort).

    Args:
        stop_reason: The engine's ``TokenOutput.stop_reason``.
        num_tokens: Tokens the call returned.
        requested: The ``max_tokens`` the loop asked for.
        turn_cap: The loop's per-turn cap (None: no cap, ``requested`` was the budget left).
    """
    if stop_reason != "length":
        return None
    if num_tokens < requested:
        return "context"  # the engine gave fewer than asked: it clamped to its context
    if turn_cap is not None and requested >= turn_cap:
        return "turn_cap"
    return "response_budget"


@dataclass
class StopCounter:
    """One trajectory's counts; :meth:`metrics` goes into its output's ``metrics``."""

    turns: int = 0
    """``generate`` calls."""
    turn_cap: int = 0
    """Calls stopped by the per-turn cap."""
    context: int = 0
    """Calls stopped by the engine's context."""
    response_budget: bool = False
    """Whether the trajectory ran into its response budget."""

    def add(self, stop_reason: str, num_tokens: int, requested: int, turn_cap: int | None) -> str | None:
        """Count one ``generate`` call (arguments as :func:`length_stop_cause`); returns its cause."""
        self.turns += 1
        cause = length_stop_cause(stop_reason, num_tokens, requested, turn_cap)
        if cause == "turn_cap":
            self.turn_cap += 1
        elif cause == "context":
            self.context += 1
        elif cause == "response_budget":
            self.response_budget = True
        return cause

    def metrics(self) -> dict[str, float]:
        """The counts under this module's keys."""
        return {TURNS: float(self.turns), TURN_CAP: float(self.turn_cap), CONTEXT: float(self.context),
                RESPONSE_BUDGET: float(self.response_budget)}


def stopped_on_a_limit(sample_metrics: Mapping[str, Any]) -> bool:
    """Whether a sample's loop stopped a ``generate`` call on a length limit: the per-turn cap,
    the engine's context, or the response budget (its :class:`StopCounter` counts)."""
    return (float(sample_metrics.get(TURN_CAP, 0)) > 0 or float(sample_metrics.get(CONTEXT, 0)) > 0
            or bool(sample_metrics.get(RESPONSE_BUDGET)))


def truncation_metrics(sample_metrics: list[dict[str, Any]], response_lengths: list[int],
                       response_length: int | None, padding_cut: list[bool]) -> dict[str, float]:
    """The batch's ``rollout/truncated/*`` metrics over successful samples.

    Args:
        sample_metrics: Each sample's (last segment's) ``metrics``.
        response_lengths: Each sample's response tokens (all of its segments').
        response_length: The response budget (None: unknown, so only the loops' flags count).
        padding_cut: Whether padding had to cut the sample (``RolloutBatch.truncated``).

    Returns:
        ``rollout/truncated/turn_cap`` (fraction of samples with a turn stopped by the per-turn
        cap), ``rollout/truncated/turn_cap_turns`` (fraction of turns), ``.../context``,
        ``.../response_budget`` (fraction of samples: the loop's flag, a response as long as
        the budget, or a sample padding cut) and ``.../any``. The turn and context fractions
        only when some loop reported them (:data:`TURNS`).
    """
    n = len(sample_metrics)
    if not n:
        return {}
    budget = [bool(m.get(RESPONSE_BUDGET)) or cut or (response_length is not None and length >= response_length)
              for m, length, cut in zip(sample_metrics, response_lengths, padding_cut, strict=True)]
    out = {"rollout/truncated/response_budget": sum(budget) / n}
    reported = [m for m in sample_metrics if TURNS in m]
    if not reported:
        out["rollout/truncated/any"] = out["rollout/truncated/response_budget"]
        return out
    turns = sum(float(m[TURNS]) for m in reported)
    capped = [float(m.get(TURN_CAP, 0)) for m in sample_metrics]
    context = [float(m.get(CONTEXT, 0)) for m in sample_metrics]
    out["rollout/truncated/turn_cap"] = sum(c > 0 for c in capped) / n
    out["rollout/truncated/turn_cap_turns"] = sum(capped) / turns if turns else 0.0
    out["rollout/truncated/context"] = sum(c > 0 for c in context) / n
    out["rollout/truncated/any"] = sum(b or stopped_on_a_limit(m) for b, m in zip(budget, sample_metrics, strict=True)) / n
    return out


__all__ = ["CONTEXT", "RESPONSE_BUDGET", "STOP_METRICS", "TURNS", "TURN_CAP", "StopCounter", "length_stop_cause",
           "stopped_on_a_limit", "truncation_metrics"]
