"""A tool-use loop written with the ``anthropic`` SDK, run by ``http_agent`` unchanged.

``run(base_url, row)`` calls ``messages.create`` with a calculator tool, runs every ``tool_use``
block and answers it with a ``tool_result``, until the model stops for another reason than
``tool_use``. The gateway's Messages route records each call's exact token ids.

The SDK appends ``/v1/messages`` to its base URL, so it gets the session URL without ``/v1``.

    agentloop train --config examples/anthropic_calculator/config.yaml
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anthropic

from agentloop_core.imports import import_file

# The tool is shared by the SDK examples; loaded by path, as the trainer loads this file.
_shared = import_file(Path(__file__).resolve().parents[1] / "calculator_tool.py", "the examples' calculator tool")

MAX_TURNS = 4
"""Model calls one run may make."""


def run(base_url: str, row: dict[str, Any], *, stream: bool = False) -> dict[str, Any]:
    """One trajectory (synchronous: ``http_agent`` runs it on a thread of its own pool).

    Returns metrics only (``finished``: the model ended its answer itself; ``tool_calls``), so
    the reward is the trainer's scorer of the row's ``data_source``. With ``stream`` each call
    is streamed (``messages.stream``); the recorded ids are the same.
    """
    # The gateway takes any key (x-api-key or bearer) and any model name; a retry would resend a
    # call the gateway refused because the response budget is spent.
    with anthropic.Anthropic(base_url=base_url.removesuffix("/v1"), api_key="unused", max_retries=0) as client:
        return _tool_loop(client, row, stream)


def run_streamed(base_url: str, row: dict[str, Any]) -> dict[str, Any]:
    """:func:`run` with every call streamed (``agent: examples/anthropic_calculator/agent.py:run_streamed``)."""
    return run(base_url, row, stream=True)


def _tool_loop(client: anthropic.Anthropic, row: dict[str, Any], stream: bool) -> dict[str, Any]:
    system, messages = _shared.instructions(row), _shared.conversation(row)
    tool_calls = 0
    for _ in range(MAX_TURNS):
        # max_tokens is required by the API; the gateway caps it to the trainer's budget.
        request: dict[str, Any] = {"model": "policy", "max_tokens": 1024, "system": system, "messages": messages,
                                   "tools": [_shared.CALCULATOR_SCHEMA]}
        if stream:
            with client.messages.stream(**request) as events:
                reply = events.get_final_message()
        else:
            reply = client.messages.create(**request)
        messages.append({"role": "assistant", "content": reply.content})
        if reply.stop_reason != "tool_use":
            # "max_tokens": the reply was cut at the trainer's max_tokens_per_turn.
            return {"metrics": {"finished": int(reply.stop_reason == "end_turn"), "tool_calls": tool_calls}}
        results = [{"type": "tool_result", "tool_use_id": block.id,
                    "content": _shared.calculator(block.input.get("expression", ""))}
                   for block in reply.content if block.type == "tool_use"]
        tool_calls += len(results)
        messages.append({"role": "user", "content": results})
    return {"metrics": {"finished": 0, "tool_calls": tool_calls}}
