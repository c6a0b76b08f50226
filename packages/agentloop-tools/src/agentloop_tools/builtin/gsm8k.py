"""A GSM8K answer-check tool: the model submits an answer, the tool says whether it is right.

The per-trajectory ground truth comes from the dataset row
(``tools_kwargs["check_answer"]["create_kwargs"]["ground_truth"]``); the reward is 1.0 for a
correct answer and 0.0 otherwise, and :meth:`Gsm8kTool.calc_reward` returns the best one seen.
A row's ``calc_reward_kwargs={"ground_truth": ...}`` re-scores the submitted answers against
another ground truth (e.g. the reward model's label, when create_kwargs carried a hint).
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation
from typing import Any

from agentloop_tools.base import BaseTool
from agentloop_tools.schema import OpenAIFunctionToolSchema, ToolResponse

__all__ = ["Gsm8kTool", "parse_number"]

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")


def parse_number(text: Any) -> Decimal | None:
    """Read the answer number from free text, leniently.

    Handles ``"42"``, ``"1,234"``, ``"$5"``, ``"#### 42"``, ``"-3.50"``, ``"The answer is 7."``:
    the number after the last ``####`` if present, else the last number in the text.

    Returns:
        The number as a Decimal (so ``5`` == ``5.00``), or None if there is none.
    """
    if isinstance(text, bool) or text is None:
        return None
    if isinstance(text, (int, float)):
        text = repr(text)
    text = str(text)
    if "####" in text:
        text = text.rsplit("####", 1)[1]
    matches = _NUMBER.findall(text.replace("$", "").replace("\u2212", "-"))
    if not matches:
        return None
    try:
        return Decimal(matches[-1].replace(",", ""))
    except InvalidOperation:
        return None


class Gsm8kTool(BaseTool):
    """Checks a submitted answer against the row's ground truth.

    Config keys: ``timeout_s`` (see BaseTool). The default schema names the tool
    ``check_answer`` with one string argument ``answer``.
    """

    def default_tool_schema(self) -> OpenAIFunctionToolSchema:
        return OpenAIFunctionToolSchema.model_validate(
            {
                "type": "function",
                "function": {
                    "name": "check_answer",
                    "description": "Check your final answer to the math problem; you are told whether it is correct.",
                    "parameters": {
                        "type": "object",
                        "properties": {
                            "answer": {"type": "string", "description": "The final numeric answer, e.g. \"42\"."}
                        },
                        "required": ["answer"],
                    },
                },
            }
        )

    async def init_state(self, ground_truth: Any = None, **extra: Any) -> dict[str, Any]:
        """Args:
            ground_truth: The expected answer (number or text such as ``"#### 42"``).

        Raises:
            ValueError: No ground truth, or it contains no number.
        """
        if extra:
            raise ValueError(f"tool {self.name!r}: unexpected create kwargs {sorted(extra)}; only 'ground_truth'")
        expected = parse_number(ground_truth)
        if expected is None:
            raise ValueError(
                f"tool {self.name!r} needs a numeric ground_truth in create_kwargs, got {ground_truth!r}"
            )
        return {"ground_truth": expected, "best_reward": 0.0, "attempts": 0, "answers": []}

    async def execute(
        self, instance_id: str, parameters: dict[str, Any]
    ) -> tuple[ToolResponse, float, dict[str, Any]]:
        state = self.state(instance_id)
        state["attempts"] += 1
        raw = parameters.get("answer")
        answer = parse_number(raw)
        state["answers"].append(answer)
        if answer is None:
            text, reward = f"Could not find a number in the answer {str(raw)[:100]!r}.", 0.0
        elif answer == state["ground_truth"]:
            text, reward = "Correct.", 1.0
        else:
            text, reward = f"Incorrect: {_plain(answer)} is not the answer.", 0.0
        state["best_reward"] = max(state["best_reward"], reward)
        return ToolResponse(text=text), reward, {"attempts": state["attempts"]}

    async def calc_reward(self, instance_id: str, ground_truth: Any = None) -> float:
        """1.0 when an answer was correct, else 0.0.

        Args:
            instance_id: From :meth:`create`.
            ground_truth: The row's ``calc_reward_kwargs["ground_truth"]``: score the submitted
                answers against it instead of the create-time ground truth.

        Raises:
            ValueError: ``ground_truth`` contains no number.
        """
        state = self.state(instance_id)
        if ground_truth is None:
            return float(state["best_reward"])
        expected = parse_number(ground_truth)
        if expected is None:
            raise ValueError(f"tool {self.name!r}: calc_reward_kwargs ground_truth {ground_truth!r} has no number")
        return float(any(answer == expected for answer in state["answers"]))


def _plain(value: Decimal) -> str:
    return format(value.normalize(), "f") if value == value.to_integral_value() else str(value)
