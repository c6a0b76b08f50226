"""The synthetic calculator task: arithmetic word problems whose answer needs one tool call.

Each problem comes from one of ten templates with two or three numbers. A demonstration is the
trajectory a tool-using model should produce: one assistant turn calling ``calculator`` with
the expression, the tool's result, and a final assistant turn ``#### N``.

The teacher that writes the SFT demonstrations is deliberately biased: for three templates it
flips the last operator in most demonstrations. SFT copies that bias; GRPO, rewarded only on
the final answer, can correct it. Random noise would not work: the right token would stay the
most likely one and greedy accuracy would not move (see MACHINE_NOTES.md).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

BUILTIN_TOOL_CONFIG = Path(__file__).parent / "calculator_tools.yaml"
"""Tool config of the built-in calculator task (the ``calculator`` tool)."""
SYSTEM_PROMPT = "Solve the problem. Call the calculator, then answer as #### N."
"""System turn of every prompt: short, because every SFT and RL token pays for it."""

AGENT_NAME = "tool_agent"
DATA_SOURCE = "agentloop/calculator"

_NAMES = ["Ann", "Ben", "Cara", "Dev", "Eli", "Fay", "Gus", "Hana", "Ivo", "Jo", "Kai", "Lea"]
_ITEMS = ["apples", "books", "coins", "eggs", "marbles", "pens", "cookies", "stamps", "cards", "shells"]


@dataclass(frozen=True)
class Template:
    """One problem shape: text with ``{a}``, ``{b}``, ``{c}`` slots and its expression."""

    text: str
    """Problem text; may use ``{name}``, ``{item}``, ``{a}``, ``{b}``, ``{c}``."""
    expression: str
    """Correct expression over ``{a}``, ``{b}``, ``{c}`` with spaces around operators."""
    sample: Callable[[random.Random], tuple[int, ...]]
    """Draws the numbers so every answer (correct or flipped) is a non-negative integer."""


def _two(lo: int, hi: int) -> Callable[[random.Random], tuple[int, ...]]:
    return lambda r: (r.randint(lo, hi), r.randint(lo, hi))


def _sub2(r: random.Random) -> tuple[int, ...]:
    b = r.randint(2, 40)
    return (b + r.randint(1, 50), b)


def _div2(r: random.Random) -> tuple[int, ...]:
    b = r.randint(2, 9)
    return (b * r.randint(2, 12), b)


def _abc(r: random.Random) -> tuple[int, ...]:
    c = r.randint(2, 30)
    b = r.randint(2, 30)
    return (b + c + r.randint(1, 40), b, c)


def _mul_add(r: random.Random) -> tuple[int, ...]:
    return (r.randint(2, 9), r.randint(2, 9), r.randint(2, 20))


def _mul_sub(r: random.Random) -> tuple[int, ...]:
    a, b = r.randint(3, 9), r.randint(3, 9)
    return (a, b, r.randint(1, a * b - 1))


def _three_sum(r: random.Random) -> tuple[int, ...]:
    a, b = r.randint(2, 40), r.randint(2, 40)
    return (a, b, r.randint(2, min(40, a + b)))


def _sum_div(r: random.Random) -> tuple[int, ...]:
    c = r.randint(2, 6)
    total = c * r.randint(2, 15)
    a = r.randint(1, total - 1)
    return (a, total - a, c)


TEMPLATES: tuple[Template, ...] = (
    Template("{name} has {a} {item}. {name} gets {b} more. How many {item} does {name} have now?",
             "{a} + {b}", _two(2, 60)),
    Template("{name} has {a} {item} and gives away {b}. How many {item} are left?", "{a} - {b}", _sub2),
    Template("{name} buys {a} boxes with {b} {item} in each box. How many {item} is that in total?",
             "{a} * {b}", _two(2, 12)),
    Template("{name} shares {a} {item} equally among {b} friends. How many {item} does each friend get?",
             "{a} / {b}", _div2),
    Template("{name} has {a} {item}, finds {b} more and then loses {c}. How many {item} are left?",
             "{a} + {b} - {c}", _abc),
    Template("{name} has {a} bags with {b} {item} in each bag and {c} loose {item}. How many {item} in all?",
             "{a} * {b} + {c}", _mul_add),
    Template("{name} has {a} {item}, sells {b} and then makes {c} more. How many {item} does {name} have?",
             "{a} - {b} + {c}", _abc),
    Template("{name} fills {a} boxes with {b} {item} each and eats {c}. How many {item} are left?",
             "{a} * {b} - {c}", _mul_sub),
    Template("{name} has {a} {item} and gets {b} more, then splits them into {c} equal groups. "
             "How many {item} are in each group?", "({a} + {b}) / {c}", _sum_div),
    Template("{name} collects {a} {item} on the first day, {b} on the second day and {c} on the third day. "
             "How many {item} in total?", "{a} + {b} + {c}", lambda r: _three_sum(r)),
)
"""The ten problem templates."""

BIASED_TEMPLATES: tuple[int, ...] = (4, 6, 9)
"""Templates whose demonstrations the teacher gets wrong (last operator flipped)."""

_FLIP = {"+": "-", "-": "+"}


@dataclass(frozen=True)
class Problem:
    """One synthetic word problem."""

    question: str
    """The problem text (the user turn)."""
    expression: str
    """The correct calculator expression."""
    answer: int
    """Ground truth."""
    template: int
    """Index into :data:`TEMPLATES`."""
    index: int = 0
    """Position in its split."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Free-form extras (unused by the task itself)."""


def evaluate_expression(expression: str) -> int:
    """Evaluate a task expression exactly (integer results only).

    Raises:
        ValueError: when the expression is not integral arithmetic over + - * / and parentheses.
    """
    allowed = set("0123456789+-*/() ")
    if not expression or set(expression) - allowed:
        raise ValueError(f"not an arithmetic expression: {expression!r}")
    value = eval(expression, {"__builtins__": {}}, {})  # noqa: S307 - charset checked above
    if float(value) != int(value):
        raise ValueError(f"{expression!r} is not an integer ({value})")
    return int(value)


def flip_last_operator(expression: str) -> str:
    """Swap the last ``+``/``-`` of an expression (the teacher's systematic mistake)."""
    for i in range(len(expression) - 1, -1, -1):
        if expression[i] in _FLIP:
            return expression[:i] + _FLIP[expression[i]] + expression[i + 1 :]
    return expression


def make_problem(rng: random.Random, template: int, index: int = 0) -> Problem:
    """Draw one problem from ``TEMPLATES[template]``."""
    t = TEMPLATES[template]
    nums = t.sample(rng)
    slots = dict(zip("abc", nums, strict=False))
    question = t.text.format(name=rng.choice(_NAMES), item=rng.choice(_ITEMS), **slots)
    expression = t.expression.format(**slots)
    return Problem(question, expression, evaluate_expression(expression), template, index)


def make_problems(n: int, seed: int) -> list[Problem]:
    """``n`` problems, templates drawn uniformly, reproducible from ``seed``."""
    rng = random.Random(seed)
    return [make_problem(rng, rng.randrange(len(TEMPLATES)), i) for i in range(n)]


def prompt_messages(problem: Problem) -> list[dict[str, Any]]:
    """The chat messages a policy sees for ``problem`` (system + user)."""
    return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": problem.question}]


def demonstration(problem: Problem, rng: random.Random, flip_prob: float = 0.6,
                  biased_templates: tuple[int, ...] = BIASED_TEMPLATES) -> list[dict[str, Any]]:
    """The teacher's full conversation for ``problem``: prompt, tool call, tool result, answer.

    For templates in ``biased_templates`` the teacher flips the last operator with probability
    ``flip_prob``; the tool result and final answer then follow the flipped expression, so the
    demonstration is self-consistent but wrong.
    """
    expression = problem.expression
    if problem.template in biased_templates and rng.random() < flip_prob:
        expression = flip_last_operator(expression)
    result = evaluate_expression(expression)
    call = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": expression}}}
    return [
        *prompt_messages(problem),
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "name": "calculator", "content": str(result)},
        {"role": "assistant", "content": f"#### {result}"},
    ]


def dataset_row(problem: Problem, split: str) -> dict[str, Any]:
    """A dataset row in agentloop's parquet layout (verl-compatible field names)."""
    return {
        "data_source": DATA_SOURCE,
        "agent_name": AGENT_NAME,
        "prompt": prompt_messages(problem),
        "reward_model": {"style": "rule", "ground_truth": str(problem.answer)},
        "extra_info": {
            "split": split,
            "index": problem.index,
            "template": problem.template,
            "tools_kwargs": {"calculator": {"create_kwargs": {"ground_truth": str(problem.answer)}}},
        },
    }


def calculator_tool() -> Any:
    """The calculator tool the rollout runs (``agentloop_tools.builtin.calculator``)."""
    from agentloop_tools.builtin import calculator

    return calculator


def tool_schemas() -> list[dict[str, Any]]:
    """The tool schemas a prompt is rendered with, exactly as the ``tool_agent`` loop renders
    them, so SFT demonstrations and rollouts see the same system turn."""
    return [calculator_tool().tool_schema.model_dump(exclude_none=True)]
