"""Tool faults inside a real rollout batch: every broken tool becomes error text the model
reads (or a truncated response) and a counter in the sample's metrics; the batch completes."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest
from fault_helpers import tool_call, tool_engine, tool_messages

from agentloop_core import AgentLoopManager
from agentloop_tools.base import BaseTool
from agentloop_tools.schema import ToolResponse
from agentloop_tools.truncation import TRUNCATION_MARKER

MAX_CHARS = 512


def _schema(name: str) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "description": f"the {name} tool", "parameters": {
        "type": "object", "properties": {"x": {"type": "string"}}, "required": ["x"]}}}


class FaultyTool(BaseTool):
    """``raise``: raises; ``hang``: sleeps an hour; ``huge``: returns 10 MB of text.

    A hang counts the calls hanging right now (``in_flight``), their peak (``peak_in_flight``)
    and the hangs cut short by cancellation (``cancelled``)."""

    def __init__(self, mode: str, **config: Any) -> None:
        super().__init__(config, _schema(mode))
        self.mode = mode
        self.in_flight = self.peak_in_flight = self.cancelled = 0

    async def execute(self, instance_id: str, parameters: dict[str, Any]):
        self.state(instance_id)
        if self.mode == "raise":
            raise RuntimeError("disk on fire")
        if self.mode == "hang":
            self.in_flight += 1
            self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                self.cancelled += 1
                raise
            finally:
                self.in_flight -= 1
        return ToolResponse(text="A" * (10 * 2**20)), 0.0, {}


def _manager(tokenizer, tools: dict[str, BaseTool], latency_s: float = 0.0, **config: Any):
    def turns(request_id: str, index: int) -> str:
        name = request_id.split("-")[0]
        return tool_call(name, **({"a": 2, "b": 3} if name == "add" else {"x": "go"})) if index < 2 else "done"

    engine = tool_engine(tokenizer, turns, latency_s=latency_s)
    cfg = {"default_agent_loop": "tool_agent", "tools": tools, "response_length": 4096,
           "max_tool_response_length": MAX_CHARS, "sampling_params": {"max_tokens": 200}, **config}
    return engine, AgentLoopManager(engine, tokenizer, cfg)


def _rows(names: list[str], per_tool: int) -> list[dict[str, Any]]:
    return [{"raw_prompt": [{"role": "user", "content": f"use {n} please"}], "request_id": f"{n}-{i}"}
            for n in names for i in range(per_tool)]


async def test_raising_hanging_and_huge_tools_become_messages_and_the_batch_completes(tokenizer):
    tools = {"raise": FaultyTool("raise"), "hang": FaultyTool("hang", timeout_s=0.5), "huge": FaultyTool("huge")}
    engine, manager = _manager(tokenizer, tools)
    # wait_for only turns a hang into a failure; the checks below are on what happened.
    outputs = await asyncio.wait_for(manager.agenerate_outputs(_rows(list(tools), 4)), timeout=60)
    assert len(outputs) == 12, [o.metrics.get("error") for o in outputs]
    assert not any(o.failed for o in outputs), [o.metrics.get("error") for o in outputs]
    # The four trajectories' hangs overlapped (the batch did not run them one at a time) and
    # every one of the 8 hung calls was cancelled by its timeout, none left running.
    hang = tools["hang"]
    assert hang.peak_in_flight > 1, "hung calls of different trajectories never overlapped"
    assert (hang.cancelled, hang.in_flight) == (8, 0), (hang.cancelled, hang.in_flight)
    for out in outputs:
        name = out.extra_fields["request_id"].split("-")[0]
        messages = tool_messages(out)
        assert len(messages) == 2
        assert out.extra_fields["termination_reason"] == "no_tool_call"
        assert out.metrics["tool_calls"] == 2
        if name == "raise":
            assert all(m == "Error: tool 'raise' failed: RuntimeError: disk on fire" for m in messages)
            assert out.metrics["tool_errors"] == 2
        elif name == "hang":
            assert all(m == "Error: tool 'hang' timed out after 0.5 s." for m in messages)
            assert out.metrics["tool_errors"] == 2
        else:
            assert out.metrics["tool_errors"] == 0
            assert all(len(m) == MAX_CHARS + len(TRUNCATION_MARKER) and TRUNCATION_MARKER in m for m in messages)
    # The 10 MB never reached the model's context: every trajectory stays small.
    assert max(len(o.prompt_ids) + len(o.response_ids) for o in outputs) < 4096


def _mcp_config(url: str, **extra: Any) -> dict[str, Any]:
    return {"mcpServers": {"calc": {"url": url, "transport": "http", "connect_retries": 2,
                                    "retry_backoff_s": 0.1, "timeout_s": 5, **extra}}}


async def test_mcp_server_down_at_start_is_a_clear_error_before_any_rollout(mcp_server, caplog):
    from agentloop_tools.mcp import aload_mcp_tools

    caplog.set_level(logging.INFO, logger="agentloop_tools.mcp")
    server = mcp_server()
    server.stop()  # the port is free again: nothing listens there
    with pytest.raises(ConnectionError) as info:
        await asyncio.wait_for(aload_mcp_tools(_mcp_config(server.url)), timeout=60)
    message = str(info.value)
    assert "'calc'" in message
    assert server.url in message
    assert "connect_retries" in message
    # It gives up after exactly connect_retries attempts, instead of retrying on and on.
    attempts = [r.getMessage() for r in caplog.records if "connect attempt" in r.getMessage()]
    assert len(attempts) == 2, attempts
    assert "attempt 2/2 failed" in attempts[-1], attempts


async def test_mcp_server_that_goes_away_mid_run_turns_calls_into_errors(tokenizer, mcp_server):
    from agentloop_tools.mcp import MCPTool, aload_mcp_tools

    served: list[str] = []
    three_served = asyncio.Event()

    class Recording(MCPTool):
        async def execute(self, instance_id, parameters):
            result = await super().execute(instance_id, parameters)
            served.append(result[0].text)
            if len(served) >= 3:
                three_served.set()
            return result

    server = mcp_server()
    tools = await aload_mcp_tools(_mcp_config(server.url), tool_class=Recording)
    engine, manager = _manager(tokenizer, tools, latency_s=0.3)

    async def kill_after_first_calls() -> None:
        await three_served.wait()
        server.stop()

    killer = asyncio.create_task(kill_after_first_calls())
    outputs = await asyncio.wait_for(manager.agenerate_outputs(_rows(["add"], 8)), timeout=90)
    await asyncio.wait_for(killer, 5)
    assert not any(o.failed for o in outputs), [o.metrics.get("error") for o in outputs]
    messages = [m for o in outputs for m in tool_messages(o)]
    assert len(messages) == 16
    ok = [m for m in messages if m == "5"]
    errors = [m for m in messages if m.startswith("Error: tool 'add' failed: ConnectionError: MCP server 'calc'")]
    assert len(ok) >= 3, messages
    assert errors, messages
    assert len(ok) + len(errors) == 16, messages
    assert sum(o.metrics["tool_errors"] for o in outputs) == len(errors)


async def test_mcp_server_that_rate_limits_gives_error_text_not_a_crash(tokenizer, mcp_server):
    from agentloop_tools.mcp import aload_mcp_tools

    server = mcp_server(max_calls=4)  # HTTP 429 for every tools/call after the 4th
    tools = await aload_mcp_tools(_mcp_config(server.url, rate_limit=50, rate_burst=2))
    engine, manager = _manager(tokenizer, tools)
    outputs = await asyncio.wait_for(manager.agenerate_outputs(_rows(["add"], 6)), timeout=90)
    assert not any(o.failed for o in outputs), [o.metrics.get("error") for o in outputs]
    messages = [m for o in outputs for m in tool_messages(o)]
    assert messages.count("5") == 4, messages
    limited = [m for m in messages if m != "5"]
    assert len(limited) == 8, limited
    assert all(m.startswith("Error: tool 'add' failed") for m in limited), limited
    assert all("error response" in m for m in limited), limited
    assert sum(o.metrics["tool_errors"] for o in outputs) == 8
