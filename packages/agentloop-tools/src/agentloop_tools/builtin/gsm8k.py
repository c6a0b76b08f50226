"""A GSM8K answer-check tool: the model submits an answer, the tool says whether it is right.

The per-trajectory ground truth comes from the dataset row
(``tools_kwargs["check_answer"]["create_kwargs"]["ground_truth"]``). A row's
``calc_reward_kwargs={"ground_truth": ...}`` re-scores the submitted answers against another
ground truth (e.g. the reward model's label, when create_kwargs carried a hint).

**It cannot be searched.** A checker that says "correct" or "incorrect" to every guess, and
rewards the best guess, lets a policy enumerate answers instead of solving the problem. So by
default each trajectory gets ``max_attempts=1`` checked answer (later calls are refused, with
no verdict), the trajectory's reward (:meth:`Gsm8kTool.calc_reward`, 1.0 or 0.0) is that of
its ``score="last"`` checked answer, and a call itself earns nothing (a reward per correct call
would pay for repeating the answer). Opt-outs, for a curriculum that wants retries:
``max_attempts: null`` (or N) and ``score: best`` in the tool's ``config:``. The contract of
every built-in task is in ``docs/task-contracts.md``.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation
from typing import Any

from agentloop_tools.base import BaseTool
from agentloop_tools.schema import OpenAIFunctionToolSchema, ToolResponse

__all__ = ["SCORES", "Gsm8kTool", "parse_number"]

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


SCORES = ("last", "best")
"""Values of the ``score`` config key: the checked answer the reward is read from."""


class Gsm8kTool(BaseTool):
    """Checks a submitted answer against the row's ground truth.

    Config keys: ``timeout_s`` (see BaseTool); ``max_attempts`` (answers checked per trajectory,
    default 1; null: unlimited, which makes the tool an oracle to search); ``score`` (``last``,
    default: the reward is the last checked answer's; ``best``: any correct checked answer earns
    1.0). The default schema names the tool ``check_answer`` with one string argument ``answer``.

    Raises:
        ValueError: ``max_attempts`` is not a positive integer or null, or ``score`` is not in
            :data:`SCORES`.
    """

    def __init__(self, config: dict[str, Any] | None = None, tool_schema: Any = None) -> None:
        super().__init__(config, tool_schema)
        attempts = self.config.get("max_attempts", 1)
        if attempts is not None and (isinstance(attempts, bool) or not isinstance(attempts, int) or attempts < 1):
            raise ValueError(f"tool {self.name!r}: config max_attempts must be a positive integer or null "
                             f"(unlimited), got {attempts!r}")
        score = self.config.get("score", "last")
        if score not in SCORES:
            raise ValueError(f"tool {self.name!r}: config score must be one of {SCORES}, got {score!r}")
        self.max_attempts: int | None = attempts
        self.score: str = score

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
        return {"ground_truth": expected, "attempts": 0, "refused": 0, "answers": []}

    # No **kwargs on purpose: check_lifecycle_kwargs reads this signature, so a row's
    # execute_kwargs are refused at create() instead of being ignored.
    async def execute(  # pyright: ignore[reportIncompatibleMethodOverride]
        self, instance_id: str, parameters: dict[str, Any]
    ) -> tuple[ToolResponse, float, dict[str, Any]]:
        """Check one answer: 0.0 as the call's reward whatever the verdict (the trajectory's
        reward is :meth:`calc_reward`'s); past ``max_attempts`` the answer is not checked. Its
        metrics count this call (``attempts``: checked, ``refused``: not), as the loop adds them up."""
        state = self.state(instance_id)
        if self.max_attempts is not None and state["attempts"] >= self.max_attempts:
            state["refused"] += 1
            text = (f"No attempts left: {self.name} checks {self.max_attempts} answer(s) per problem and this one "
                    "was not checked; your checked answer stands.")
            return ToolResponse(text=text), 0.0, {"attempts": 0, "refused": 1}
        state["attempts"] += 1
        raw = parameters.get("answer")
        answer = parse_number(raw)
        state["answers"].append(answer)
        if answer is None:
            text = f"Could not find a number in the answer {str(raw)[:100]!r}."
        elif answer == state["ground_truth"]:
            text = "Correct."
        else:
            text = f"Incorrect: {_plain(answer)} is not the answer."
        return ToolResponse(text=text), 0.0, {"attempts": 1, "refused": 0}

    async def calc_reward(self, instance_id: str, ground_truth: Any = None) -> float:
        """1.0 when the last checked answer is correct (``score="best"``: any), else 0.0; 0.0
        with no checked answer.

        Args:
            instance_id: From :meth:`create`.
            ground_truth: The row's ``calc_reward_kwargs["ground_truth"]``: score the submitted
                answers against it instead of the create-time ground truth.

        Raises:
            ValueError: ``ground_truth`` contains no number.
        """
        state = self.state(instance_id)
        expected = state["ground_truth"] if ground_truth is None else parse_number(ground_truth)
        if expected is None:
            raise ValueError(f"tool {self.name!r}: calc_reward_kwargs ground_truth {ground_truth!r} has no number")
        answers = state["answers"] if self.score == "best" else state["answers"][-1:]
        return float(any(answer == expected for answer in answers))


def _plain(value: Decimal) -> str:
    return format(value.normalize(), "f") if value == value.to_integral_value() else str(value)
