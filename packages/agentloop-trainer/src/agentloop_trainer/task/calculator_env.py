"""The calculator task as an environment (registered as ``calculator`` in the
``agentloop.environments`` entry points): the same problems, tool and reward as the built-in
``tool_agent`` task, written as ``reset`` / ``step``.

A turn with calls gets one tool message per call (the calculator's result, or the error the
model should fix) and reward 0; the first turn without calls is the answer: reward 1.0 when
its ``#### N`` equals the ground truth (:func:`~agentloop_trainer.reward.rule.answer_reward`,
the scorer of ``agentloop/calculator``), else 0, and the episode ends.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from agentloop_core.environment import AssistantTurn, Environment, StepResult, register_environment
from agentloop_trainer.reward.rule import answer_reward
from agentloop_trainer.task.calculator import calculator_tool, dataset_row, make_problems

__all__ = ["DATA_SOURCE", "CalculatorEnv", "calculator_env_rows"]

DATA_SOURCE = "agentloop/calculator_env"
"""Rows' ``data_source``: not ``agentloop/calculator``, so ``reward.source=auto`` keeps the
environment's reward (the same 0/1 answer check)."""


@register_environment("calculator")
class CalculatorEnv(Environment):
    """One word problem; the ``calculator`` tool; the final ``#### N`` scored against the row's
    ground truth."""

    def __init__(self) -> None:
        self.ground_truth = ""

    def tool_schemas(self) -> list[dict[str, Any]]:
        return [calculator_tool().tool_schema.model_dump(exclude_none=True)]

    async def reset(self, row: Mapping[str, Any]) -> Sequence[Mapping[str, Any]]:
        truth = row.get("ground_truth", (row.get("reward_model") or {}).get("ground_truth"))
        if truth is None:
            raise ValueError("calculator environment needs the row's ground truth (reward_model.ground_truth)")
        self.ground_truth = str(truth)
        return await super().reset(row)

    async def step(self, turn: AssistantTurn) -> StepResult:
        if not (turn.tool_calls or turn.tool_call_errors):
            return StepResult([], answer_reward(turn.content, self.ground_truth), True, {})
        from agentloop_tools.builtin.calculator import CalculatorError, evaluate_expression, format_number

        messages = []
        for call, call_id in zip(turn.tool_calls, turn.tool_call_ids, strict=True):
            try:
                text = format_number(evaluate_expression(str(call.arguments.get("expression", ""))))
            except CalculatorError as exc:
                text = f"Error: {exc}"
            messages.append({"role": "tool", "name": call.name, "tool_call_id": call_id, "content": text})
        for error, call_id in zip(turn.tool_call_errors, turn.error_call_ids, strict=True):
            messages.append({"role": "tool", "name": error.name or "", "tool_call_id": call_id,
                             "content": f"Error: {error.reason}"})
        return StepResult(messages, 0.0, False, {"tool_calls": len(messages)})


def calculator_env_rows(n: int, seed: int, split: str) -> list[dict[str, Any]]:
    """``n`` calculator problems as ``env_agent`` rows."""
    rows = []
    for problem in make_problems(n, seed):
        row = dataset_row(problem, split)
        extra = {k: v for k, v in row["extra_info"].items() if k != "tools_kwargs"}
        rows.append({**row, "data_source": DATA_SOURCE, "agent_name": "env_agent",
                     "extra_info": {**extra, "environment": "calculator"}})
    return rows
