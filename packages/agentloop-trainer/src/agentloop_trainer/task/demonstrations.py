"""SFT demonstrations of the calculator task in verl's multi-turn layout
(``agentloop data calculator-sft``): system, user, an assistant turn calling ``calculator``
with the expression, the result the real calculator tool returns, the final answer."""

from __future__ import annotations

import random
from typing import Any

DEFAULT_ANSWER_FORMAT = "#### {answer}"
"""The final answer the built-in task's scorer reads."""


def system_prompt(answer_format: str) -> str:
    """The task's system turn for an answer written as ``answer_format`` (the built-in
    :data:`~agentloop_trainer.task.calculator.SYSTEM_PROMPT` for ``#### {answer}``)."""
    shown = answer_format.format(answer="N").rstrip(".")
    return f"Solve the problem. Call the calculator, then answer as {shown}."


def calculator_rows(n: int, seed: int = 0, flip_prob: float = 0.0,
                    answer_format: str = DEFAULT_ANSWER_FORMAT) -> list[dict[str, Any]]:
    """``n`` demonstration rows for problems drawn with ``seed``.

    Args:
        n: Rows.
        seed: Seed of the problems and of the teacher's mistakes.
        flip_prob: Chance the teacher flips the last operator on the biased templates (the
            tiny demo's teacher); 0: a correct teacher.
        answer_format: The final assistant message, with ``{answer}`` for the number (e.g.
            ``The answer is {answer}.``); match the scorer.

    Returns:
        Rows with ``messages``, ``tools`` (the calculator's schema), ``data_source`` and
        ``extra_info`` (index, template, ground truth, the expression the teacher used).

    Raises:
        ValueError: ``answer_format`` has no ``{answer}``.
    """
    from agentloop_trainer.task.calculator import (
        BIASED_TEMPLATES,
        DATA_SOURCE,
        calculator_tool,
        flip_last_operator,
        make_problems,
        tool_schemas,
    )

    if "{answer}" not in answer_format:
        raise ValueError(f"answer format {answer_format!r} has no {{answer}} slot; e.g. '#### {{answer}}'")
    tool = calculator_tool()
    schemas = tool_schemas()
    rng = random.Random(seed * 1_000_003 + 17)
    rows = []
    for p in make_problems(n, seed):
        expression = p.expression
        if p.template in BIASED_TEMPLATES and flip_prob > 0 and rng.random() < flip_prob:
            expression = flip_last_operator(expression)
        result = str(tool.fn(expression))  # the tool's own text, as the rollout shows it
        call_id = f"call_{p.index}"
        messages = [
            {"role": "system", "content": system_prompt(answer_format)},
            {"role": "user", "content": p.question},
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": call_id, "type": "function",
                 "function": {"name": "calculator", "arguments": {"expression": expression}}}]},
            {"role": "tool", "name": "calculator", "tool_call_id": call_id, "content": result},
            {"role": "assistant", "content": answer_format.format(answer=result)},
        ]
        rows.append({"messages": messages, "tools": schemas, "data_source": DATA_SOURCE,
                     "extra_info": {"index": p.index, "template": p.template, "ground_truth": str(p.answer),
                                    "expression": expression}})
    return rows


