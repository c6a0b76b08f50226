"""What the tool loop does once per turn, done once: one ``SamplingParams`` per distinct
``max_tokens``, the parser's text decoded by the fast backend (the tokenizer's own text),
calls checked against the tools' schemas as rendered, and a tool call's time limit kept
without a task of its own (issue 49: CPU per trajectory at 4096 in flight)."""

from __future__ import annotations

import asyncio
import json

import pytest

from agentloop_core.testing import ScriptedServer, load_tiny_tokenizer
from agentloop_tools.agent_loop import ToolAgentLoop
from agentloop_tools.base import BaseTool
from agentloop_tools.call_limits import within
from agentloop_tools.schema import ToolResponse

PROMPT = [{"role": "user", "content": "Add 2 and 3, twice."}]


class AddTool(BaseTool):
    """Adds ``a`` and ``b``; records the task each call ran in."""

    def __init__(self) -> None:
        super().__init__({}, {"type": "function", "function": {
            "name": "add", "description": "Add two integers.", "parameters": {
                "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "required": ["a", "b"]}}})
        self.tasks: list[asyncio.Task | None] = []

    async def execute(self, instance_id, parameters, **kwargs):
        self.tasks.append(asyncio.current_task())
        return ToolResponse(text=str(parameters["a"] + parameters["b"])), 0.0, {}


def _call(**arguments) -> str:
    return "<tool_call>\n" + json.dumps({"name": "add", "arguments": arguments}) + "\n</tool_call>"


def _build(tok, turns: list[str], **config):
    def reply(request_id, prompt_ids, index):
        return tok.encode(turns[min(index, len(turns) - 1)], add_special_tokens=False)

    server = ScriptedServer(reply, eos_token_id=tok.eos_token_id, append_eos=True)
    tool = AddTool()
    return server, tool, ToolAgentLoop(server, tok, {"tools": {"add": tool}, "response_length": 2048, **config})


def _run(tok, turns: list[str], **config):
    server, tool, loop = _build(tok, turns, **config)
    out = asyncio.run(loop.run({"max_tokens": 64, "logprobs": True}, raw_prompt=PROMPT))
    return server, tool, loop, out


def test_a_fixed_per_turn_cap_sends_one_sampling_params_object():
    tok = load_tiny_tokenizer()
    server, _, _, out = _run(tok, [_call(a=2, b=3), _call(a=2, b=3), "5 twice."])
    params = [c.sampling_params for c in server.calls]
    assert len(params) == 3
    assert out.metrics["tool_calls"] == 2
    assert all(p is params[0] for p in params)
    assert params[0].max_tokens == 64


def test_the_parser_text_is_the_tokenizers_own_without_its_wrapper(monkeypatch):
    tok = load_tiny_tokenizer()
    _, tool, loop = _build(tok, [_call(a=2, b=3), "Five."])
    decoded: list[bool] = []
    original = type(tok).decode
    # Patched once the loop (and its renderer, which looks at the tokenizer's class) is built.
    monkeypatch.setattr(type(tok), "decode", lambda self, ids, *a, skip_special_tokens=False, **k: decoded.append(
        skip_special_tokens) or original(self, ids, *a, skip_special_tokens=skip_special_tokens, **k))
    out = asyncio.run(loop.run({"max_tokens": 64, "logprobs": True}, raw_prompt=PROMPT))
    assert out.metrics["tool_calls"] == 1
    assert out.metrics["parse_errors"] == 0
    assert [m["content"] for m in out.extra_fields["messages"] if m["role"] == "tool"] == ["5"]
    assert True not in decoded  # the parser's text came from the backend, not transformers' decode


def test_calls_are_checked_against_the_schemas_the_template_shows():
    tok = load_tiny_tokenizer()
    _, tool, loop, out = _run(tok, [_call(a=2, b="three"), "Oops."])
    assert loop.tool_specs == {"add": tool.tool_schema.model_dump(exclude_none=True)}
    assert out.metrics["parse_errors"] == 1
    assert tool.tasks == []  # "three" is not an integer: never run


def test_a_tool_call_with_a_time_limit_runs_in_its_gathered_task():
    tok = load_tiny_tokenizer()
    _, tool, _, _ = _run(tok, [_call(a=2, b=3), "Five."], tool_timeout_s=30)
    [task] = tool.tasks
    assert task is not None
    assert getattr(task.get_coro(), "__qualname__", None) == "ToolRun.call_tool"


def test_within_bounds_an_await_in_the_calling_task():
    async def main():
        caller = asyncio.current_task()
        seen = []

        async def quick():
            seen.append(asyncio.current_task())
            return 7

        assert await within(quick(), 5.0) == 7
        assert seen == [caller]
        cancelled = []

        async def slow():
            try:
                await asyncio.sleep(60)
            except asyncio.CancelledError:
                cancelled.append(True)
                raise

        with pytest.raises(TimeoutError):
            await within(slow(), 0.01)
        assert cancelled == [True]

        async def own_timeout():
            raise TimeoutError("the tool's own")

        with pytest.raises(TimeoutError, match="the tool's own"):
            await within(own_timeout(), 5.0)
        assert await within(quick(), None) == 7  # no limit

    asyncio.run(main())


def test_loops_of_the_same_tools_share_one_schema_dict_and_see_a_schema_changed_in_place():
    """A loop is built per sample (thousands in flight): they hold one dump of each tool's
    schema, not one each, and a schema changed in place still reaches the next loop."""
    tok = load_tiny_tokenizer()
    tool = AddTool()
    server = ScriptedServer(lambda *_: [1], eos_token_id=tok.eos_token_id, append_eos=True)
    first, second = (ToolAgentLoop(server, tok, {"tools": {"add": tool}, "response_length": 2048}) for _ in range(2))
    assert first.tool_specs["add"] == tool.tool_schema.model_dump(exclude_none=True)
    assert second.tool_specs["add"] is first.tool_specs["add"]
    tool.tool_schema.function.description = "Add two integers exactly."
    third = ToolAgentLoop(server, tok, {"tools": {"add": tool}, "response_length": 2048})
    assert third.tool_specs["add"]["function"]["description"] == "Add two integers exactly."
    assert first.tool_specs["add"]["function"]["description"] == "Add two integers."
