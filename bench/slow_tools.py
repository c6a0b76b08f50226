"""A slow calculator for ``bench_async.py --real --tool-median-s S``: agentloop's built-in
calculator (the same name, schema and answers, so the model sees the prompt it was trained on)
that first sleeps for a log-normal time, as a search API or a code sandbox takes.

``agentloop train`` loads it through ``actor_rollout_ref.rollout.multi_turn.function_tool_path``.
The environment sets the distribution: ``AGENTLOOP_BENCH_TOOL_MEDIAN_S`` (median seconds) and
``AGENTLOOP_BENCH_TOOL_SIGMA`` (the spread of the log; 1.0 puts the 99th percentile at about
10x the median). The draws are seeded, so every mode sees the same sequence of latencies.
"""

from __future__ import annotations

import asyncio
import importlib
import math
import os
import random

from agentloop_tools.function_tool import FunctionTool

# The module, not the tool the package re-exports under the same name (and not a module-level
# tool here: this file's only tool must be the slow one).
builtin = importlib.import_module("agentloop_tools.builtin.calculator")

MEDIAN_S = float(os.environ.get("AGENTLOOP_BENCH_TOOL_MEDIAN_S", "0.5"))
SIGMA = float(os.environ.get("AGENTLOOP_BENCH_TOOL_SIGMA", "1.0"))
_rng = random.Random(0)


async def _slow_calculator(expression: str) -> str:
    await asyncio.sleep(MEDIAN_S * math.exp(SIGMA * _rng.gauss(0.0, 1.0)))
    return builtin.calculator.fn(expression)


calculator = FunctionTool(_slow_calculator, name="calculator", schema=builtin.calculator.tool_schema)
