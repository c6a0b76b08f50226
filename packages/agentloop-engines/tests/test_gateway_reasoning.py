"""The gateway with a reasoning parser: ``reasoning_content`` in the assistant message (and its
stream), ``content`` without the reasoning, ``tool_calls`` only from the content, and the
token ids exactly what the engine generated. Scripted engine, real tiny tokenizer and template;
gpt-oss on its real template from ``../shared`` (``AGENTLOOP_CHAT_TEMPLATES`` elsewhere)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from agentloop_core.testing import ScriptedServer, load_tiny_tokenizer, tiny_tokenizer_for_template
from agentloop_engines.serving.gateway import Gateway
from agentloop_engines.testing.gateway_fixtures import hermes_call

SHARED_TEMPLATES = Path(os.environ.get("AGENTLOOP_CHAT_TEMPLATES")
                        or Path(__file__).resolve().parents[3].parent / "shared" / "data" / "chat_templates")
USER = [{"role": "user", "content": "Add 1 and 1."}]
TOOLS = [{"type": "function", "function": {"name": "calc", "description": "Evaluate.", "parameters": {
    "type": "object", "properties": {"expr": {"type": "string"}}, "required": ["expr"]}}}]


def call(expr: str) -> str:
    return hermes_call("calc", expr=expr)


def gateway_for(tokenizer, text: str, **kwargs) -> tuple[Gateway, ScriptedServer]:
    server = ScriptedServer([tokenizer.encode(text, add_special_tokens=False)], vocab_size=len(tokenizer),
                            eos_token_id=tokenizer.eos_token_id, append_eos=True)
    return Gateway(server, tokenizer, **kwargs), server


async def test_reasoning_content_and_calls_only_from_the_content():
    tokenizer = load_tiny_tokenizer()
    text = f"<think>\nMaybe {call('0+0')} first.\n</think>\n\nLet me add. {call('1+1')}"
    gateway, server = gateway_for(tokenizer, text, tool_parser="hermes", reasoning_parser="qwen3")
    out = await gateway.chat_completion({"messages": USER, "tools": TOOLS})
    choice = out.body["choices"][0]
    message = choice["message"]
    assert message["reasoning_content"] == f"Maybe {call('0+0')} first."
    assert message["content"] == "Let me add."
    assert [json.loads(c["function"]["arguments"]) for c in message["tool_calls"]] == [{"expr": "1+1"}]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["token_ids"] == server.calls[0].output.token_ids
    deltas = [c["choices"][0]["delta"] for c in out.chunks() if c["choices"]]
    assert {"reasoning_content": message["reasoning_content"]} in deltas
    # Without a reasoning parser both calls come back and content keeps the reasoning.
    plain, _ = gateway_for(tokenizer, text, tool_parser="hermes")
    message = (await plain.chat_completion({"messages": USER, "tools": TOOLS})).body["choices"][0]["message"]
    assert len(message["tool_calls"]) == 2
    assert "reasoning_content" not in message


async def test_no_tools_and_an_answer_without_reasoning():
    tokenizer = load_tiny_tokenizer()
    gateway, _ = gateway_for(tokenizer, "R1 thinks first.\n</think>\n\nIt is 2.", reasoning_parser="deepseek_r1")
    message = (await gateway.chat_completion({"messages": USER})).body["choices"][0]["message"]
    assert (message["reasoning_content"], message["content"]) == ("R1 thinks first.", "It is 2.")
    gateway, _ = gateway_for(tokenizer, "It is 2.", reasoning_parser="qwen3")
    message = (await gateway.chat_completion({"messages": USER})).body["choices"][0]["message"]
    assert message["content"] == "It is 2."
    assert "reasoning_content" not in message


def test_a_special_token_reasoning_parser_needs_a_matching_tool_parser():
    tokenizer = load_tiny_tokenizer()
    with pytest.raises(ValueError, match="tool_parser='gpt_oss'"):
        Gateway(ScriptedServer([[5]]), tokenizer, tool_parser="hermes", reasoning_parser="gpt_oss")
    with pytest.raises(KeyError, match="unknown reasoning parser"):
        Gateway(ScriptedServer([[5]]), tokenizer, reasoning_parser="nope")


async def test_gpt_oss_analysis_becomes_reasoning_content():
    path = SHARED_TEMPLATES / "openai-gpt-oss-120b.jinja"
    if not path.exists():
        pytest.skip(f"{path} is absent (the shared chat templates are not in this checkout)")
    tokenizer = tiny_tokenizer_for_template(path)
    text = ('<|channel|>analysis<|message|>Call calc.<|end|><|start|>assistant to=functions.calc'
            '<|channel|>commentary json<|message|>{"expr": "1+1"}<|call|>')
    gateway, server = gateway_for(tokenizer, text, tool_parser="gpt_oss", reasoning_parser="gpt_oss")
    choice = (await gateway.chat_completion({"messages": USER, "tools": TOOLS})).body["choices"][0]
    assert choice["message"]["reasoning_content"] == "Call calc."
    assert [c["function"]["name"] for c in choice["message"]["tool_calls"]] == ["calc"]
    assert choice["token_ids"] == server.calls[0].output.token_ids
    final = "<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>final<|message|>It is 2.<|return|>"
    gateway, _ = gateway_for(tokenizer, final, tool_parser="gpt_oss", reasoning_parser="gpt_oss")
    message = (await gateway.chat_completion({"messages": USER})).body["choices"][0]["message"]
    assert (message["reasoning_content"], message["content"]) == ("Easy.", "It is 2.")
