"""Ready-made tools: a safe calculator, a Python sandbox and a GSM8K answer checker."""

from agentloop_tools.builtin.calculator import (
    CalculatorError,
    CalculatorLimits,
    calculator,
    evaluate_expression,
    format_number,
)
from agentloop_tools.builtin.gsm8k import Gsm8kTool, parse_number
from agentloop_tools.builtin.sandbox import PythonSandboxTool, SandboxLimits, SandboxResult, run_python

__all__ = [
    "CalculatorError",
    "CalculatorLimits",
    "Gsm8kTool",
    "PythonSandboxTool",
    "SandboxLimits",
    "SandboxResult",
    "calculator",
    "evaluate_expression",
    "format_number",
    "parse_number",
    "run_python",
]
