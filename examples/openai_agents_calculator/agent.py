"""An OpenAI Agents SDK agent with a calculator tool, run by ``http_agent`` unchanged.

``run(base_url, row)`` builds an ``Agent`` whose model is ``OpenAIResponsesModel`` over an
``AsyncOpenAI`` client pointed at the trajectory's gateway session, and runs it with
``Runner.run``: every model call is a ``POST {base_url}/responses`` that the gateway records with
its exact token ids. Tracing is off, so nothing but the gateway is ever contacted.

    agentloop train --config examples/openai_agents_calculator/config.yaml
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from agents import (
    Agent,
    MaxTurnsExceeded,
    ModelBehaviorError,
    OpenAIResponsesModel,
    Runner,
    function_tool,
    set_tracing_disabled,
)
from openai import AsyncOpenAI

from agentloop_core.imports import import_file

# The tool is shared by the SDK examples; loaded by path, as the trainer loads this file.
_shared = import_file(Path(__file__).resolve().parents[1] / "calculator_tool.py", "the examples' calculator tool")

# The SDK exports traces to api.openai.com by default; a training run must not reach it.
set_tracing_disabled(True)

MAX_TURNS = 4
"""Model calls one run may make (the SDK raises MaxTurnsExceeded past it)."""

calculator = function_tool(_shared.calculator)


async def run(base_url: str, row: dict[str, Any], *, stream: bool = False) -> dict[str, Any]:
    """One trajectory: the row's system turn becomes the agent's instructions, the rest its input.

    Returns metrics only (``finished``: the agent gave a final answer; ``tool_calls``), so the
    reward is the trainer's scorer of the row's ``data_source``. With ``stream`` the agent runs
    with ``Runner.run_streamed`` (every model call a streamed Responses call); the recorded ids
    are the same.
    """
    system, conversation = _shared.instructions(row), _shared.conversation(row)
    # The gateway's session URL takes any key and any model name; a retry would resend a call the
    # gateway refused because the response budget is spent.
    async with AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0) as client:
        agent = Agent(name="calculator", instructions=system or None, tools=[calculator],
                      model=OpenAIResponsesModel(model="policy", openai_client=client))
        try:
            if stream:
                streamed = Runner.run_streamed(agent, conversation, max_turns=MAX_TURNS)
                async for _ in streamed.stream_events():
                    pass
                items = streamed.new_items
            else:
                items = (await Runner.run(agent, conversation, max_turns=MAX_TURNS)).new_items
        except (MaxTurnsExceeded, ModelBehaviorError) as exc:
            # ModelBehaviorError: a reply cut at max_output_tokens (the trainer's
            # max_tokens_per_turn) is a Responses status "incomplete", which the SDK refuses, as it
            # does a call of an unknown tool. Either way the policy's episode ended there: its
            # calls are trained on and the scorer gives the reward, rather than the sample failing.
            items = exc.run_data.new_items if exc.run_data is not None else []
            return {"metrics": {"finished": 0, "tool_calls": _tool_calls(items)}}
    return {"metrics": {"finished": 1, "tool_calls": _tool_calls(items)}}


async def run_streamed(base_url: str, row: dict[str, Any]) -> dict[str, Any]:
    """:func:`run` with ``Runner.run_streamed`` (``agent: examples/openai_agents_calculator/agent.py:run_streamed``)."""
    return await run(base_url, row, stream=True)


def _tool_calls(items: list[Any]) -> int:
    return sum(1 for item in items if item.type == "tool_call_item")
