"""The calculator tool of the agent-SDK examples, written once for all of them.

``calculator`` is a plain function (its docstring is the tool's description, its ``Args`` the
parameter's): the OpenAI Agents SDK wraps it with ``function_tool``, pydantic-ai with
``agent.tool_plain``, and the ``anthropic`` loop sends :data:`CALCULATOR_SCHEMA` and calls it
on each ``tool_use`` block. :func:`instructions` and :func:`conversation` split a trainer row's
prompt as every example does.

Each example's ``agent.py`` loads this file by its path (``agentloop_core.imports.import_file``),
as the trainer loads the agent itself, so an example runs from any working directory.
"""

from __future__ import annotations

from typing import Any

from agentloop_tools.builtin.calculator import CalculatorError, evaluate_expression

CALCULATOR_SCHEMA: dict[str, Any] = {
    "name": "calculator",
    "description": "Evaluate an arithmetic expression such as (3 + 4) * 2.",
    "input_schema": {"type": "object", "properties": {"expression": {"type": "string"}},
                     "required": ["expression"]},
}
"""``calculator`` as an Anthropic Messages tool."""


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression such as (3 + 4) * 2.

    Args:
        expression: Numbers, + - * / and parentheses.
    """
    try:
        return str(evaluate_expression(expression))
    except CalculatorError as exc:
        # The model reads the error as the tool's result and may retry; the run goes on.
        return f"error: {exc}"


def instructions(row: dict[str, Any]) -> str:
    """The row's system turns, joined: the agent's instructions ("" when there are none)."""
    return "\n".join(m["content"] for m in row["raw_prompt"] if m["role"] == "system")


def conversation(row: dict[str, Any]) -> list[dict[str, Any]]:
    """The row's other turns, as ``{"role", "content"}`` messages."""
    return [{"role": m["role"], "content": m["content"]} for m in row["raw_prompt"] if m["role"] != "system"]
