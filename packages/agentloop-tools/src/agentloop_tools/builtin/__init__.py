"""Ready-made tools: a safe calculator, a Python sandbox, a GSM8K answer checker and an image
zoom (``image_zoom_in``, for vision-language models)."""

from agentloop_tools.builtin.calculator import (
    CalculatorError,
    CalculatorLimits,
    calculator,
    evaluate_expression,
    format_number,
)
from agentloop_tools.builtin.gsm8k import Gsm8kTool, parse_number
from agentloop_tools.builtin.image_zoom import ImageZoomInTool
from agentloop_tools.builtin.sandbox import PythonSandboxTool, SandboxLimits, SandboxResult, run_python

__all__ = [
    "CalculatorError",
    "CalculatorLimits",
    "Gsm8kTool",
    "ImageZoomInTool",
    "PythonSandboxTool",
    "SandboxLimits",
    "SandboxResult",
    "calculator",
    "evaluate_expression",
    "format_number",
    "parse_number",
    "run_python",
]
