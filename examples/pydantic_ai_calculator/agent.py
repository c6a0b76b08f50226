"""A pydantic-ai agent with a calculator tool, run by ``http_agent`` unchanged.

The ``Agent`` is built once; each trajectory runs it with an ``OpenAIChatModel`` whose
``OpenAIProvider`` points at the trajectory's gateway session, so every model call is a
``POST {base_url}/chat/completions`` that the gateway records with its exact token ids.

    agentloop train --config examples/pydantic_ai_calculator/config.yaml
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from openai import AsyncOpenAI
from pydantic_ai import Agent, UsageLimits, capture_run_messages
from pydantic_ai.exceptions import UsageLimitExceeded
from pydantic_ai.messages import ToolCallPart
from pydantic_ai.models.openai import OpenAIChatModel
from pydantic_ai.providers.openai import OpenAIProvider

from agentloop_core.imports import import_file

# The tool is shared by the SDK examples; loaded by path, as the trainer loads this file.
_shared = import_file(Path(__file__).resolve().parents[1] / "calculator_tool.py", "the examples' calculator tool")

MAX_TURNS = 4
"""Model calls one run may make (pydantic-ai raises UsageLimitExceeded past it)."""

agent = Agent(name="calculator")

calculator = agent.tool_plain(_shared.calculator)


async def run(base_url: str, row: dict[str, Any]) -> dict[str, Any]:
    """One trajectory: the row's system turn becomes the run's instructions, its user turn the prompt.

    Returns metrics only (``finished``: the model ended its answer itself; ``tool_calls``), so
    the reward is the trainer's scorer of the row's ``data_source``.
    """
    system = _shared.instructions(row)
    question = "\n".join(m["content"] for m in row["raw_prompt"] if m["role"] == "user")
    # The session URL takes any key and any model name; a retry would resend a call the gateway
    # refused because the response budget is spent.
    async with AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0) as client:
        model = OpenAIChatModel("policy", provider=OpenAIProvider(openai_client=client))
        with capture_run_messages() as messages:
            try:
                result = await agent.run(question, model=model, instructions=system or None,
                                         usage_limits=UsageLimits(request_limit=MAX_TURNS))
            except UsageLimitExceeded:
                return {"metrics": {"finished": 0, "tool_calls": _tool_calls(messages)}}
    tool_calls = _tool_calls(result.all_messages())
    # finish_reason "length": the answer was cut at the trainer's max_tokens_per_turn.
    return {"metrics": {"finished": int(result.response.finish_reason != "length"), "tool_calls": tool_calls}}


def _tool_calls(messages: list[Any]) -> int:
    return sum(isinstance(part, ToolCallPart) for message in messages for part in message.parts)
