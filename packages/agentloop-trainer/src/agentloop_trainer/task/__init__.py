"""The built-in task: synthetic calculator word problems (``data.train_files`` unset), its tool
config, and its demonstrations as SFT rows.

- :mod:`~agentloop_trainer.task.calculator`: problems, templates, the biased teacher, rows.
- :mod:`~agentloop_trainer.task.demonstrations`: ``agentloop data calculator-sft``.
"""

from agentloop_trainer.task.calculator import (
    AGENT_NAME,
    BIASED_TEMPLATES,
    BUILTIN_TOOL_CONFIG,
    DATA_SOURCE,
    SYSTEM_PROMPT,
    TEMPLATES,
    Problem,
    Template,
    calculator_tool,
    dataset_row,
    demonstration,
    evaluate_expression,
    flip_last_operator,
    make_problem,
    make_problems,
    prompt_messages,
    tool_schemas,
)
from agentloop_trainer.task.demonstrations import (
    DEFAULT_ANSWER_FORMAT,
    calculator_rows,
    system_prompt,
)

__all__ = [
    "BUILTIN_TOOL_CONFIG",
    "AGENT_NAME",
    "BIASED_TEMPLATES",
    "DATA_SOURCE",
    "DEFAULT_ANSWER_FORMAT",
    "Problem",
    "SYSTEM_PROMPT",
    "TEMPLATES",
    "Template",
    "calculator_rows",
    "calculator_tool",
    "dataset_row",
    "demonstration",
    "evaluate_expression",
    "flip_last_operator",
    "make_problem",
    "make_problems",
    "prompt_messages",
    "system_prompt",
    "tool_schemas",
]
