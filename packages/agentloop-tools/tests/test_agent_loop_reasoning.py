"""``tool_agent`` with a reasoning parser, on a scripted engine: a call the model drafts inside
its reasoning is counted and not run (``tool_calls_in_reasoning`` runs it too), and the
trajectory keeps exactly the tokens the engine generated either way.

Tokenizer, chat templates, tools and loop are real: the tiny tokenizer with its ChatML template,
the same template with a generation prompt that opens ``<think>`` (as QwQ's does), and Qwen3's
real template from ``../shared`` (``AGENTLOOP_CHAT_TEMPLATES`` elsewhere; skipped when absent).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from agentloop_core.testing import ScriptedServer, load_tiny_tokenizer, tiny_tokenizer_for_template
from agentloop_tools.agent_loop import ToolAgentLoop
from agentloop_tools.function_tool import function_tool

SHARED_TEMPLATES = Path(os.environ.get("AGENTLOOP_CHAT_TEMPLATES")
                        or Path(__file__).resolve().parents[3].parent / "shared" / "data" / "chat_templates")
PROMPT = [{"role": "user", "content": "Echo something."}]
SAMPLING = {"temperature": 0.0, "logprobs": True}


@function_tool
def echo(text: str) -> str:
    """Say the text back.

    Args:
        text: What to say.
    """
    return text


def call(text: str) -> str:
    return "<tool_call>\n" + json.dumps({"name": "echo", "arguments": {"text": text}}) + "\n</tool_call>"


async def run_loop(tokenizer, turns: list[str], **config: Any):
    def reply(request_id: str, prompt_ids: list[int], index: int) -> list[int]:
        return tokenizer.encode(turns[min(index, len(turns) - 1)], add_special_tokens=False)

    server = ScriptedServer(reply, vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id, append_eos=True)
    loop = ToolAgentLoop(server, tokenizer, {"tools": {"echo": echo}, "response_length": 2048, **config})
    out = await loop.run(SAMPLING, raw_prompt=PROMPT, request_id="r")
    generated = [t for c in server.calls for t in c.output.token_ids]
    assert [t for t, m in zip(out.response_ids, out.response_mask, strict=True) if m] == generated
    return out, server


def tool_messages(out) -> list[str]:
    return [m["content"] for m in out.extra_fields["messages"] if m["role"] == "tool"]


QWEN3_TURN = f"<think>\nI could try {call('drafted')} first.\n</think>\n\n{call('real')}"


@pytest.mark.parametrize("allow", [False, True])
async def test_qwen3_call_in_reasoning_runs_only_when_allowed(allow):
    out, server = await run_loop(load_tiny_tokenizer(), [QWEN3_TURN, "Done."], reasoning_parser="qwen3",
                           tool_calls_in_reasoning=allow)
    assert tool_messages(out) == (["drafted", "real"] if allow else ["real"])
    assert out.metrics["tool_calls"] == (2 if allow else 1)
    assert out.metrics["tool_calls_in_reasoning"] == 1
    assert out.metrics["tool_calls_in_reasoning_ignored"] == (0 if allow else 1)
    assert out.metrics["reasoning_turns"] == 1
    assert out.metrics["reasoning_chars"] == len(f"I could try {call('drafted')} first.")
    assert out.metrics["reasoning_unclosed"] == 0
    assert len(server.calls) == 2


async def test_without_a_reasoning_parser_every_call_runs_and_no_reasoning_metrics():
    out, _ = await run_loop(load_tiny_tokenizer(), [QWEN3_TURN, "Done."])
    assert tool_messages(out) == ["drafted", "real"]
    assert "tool_calls_in_reasoning" not in out.metrics


async def test_deepseek_r1_reasoning_without_an_opening_tag():
    out, _ = await run_loop(load_tiny_tokenizer(), [f"Maybe {call('drafted')}.\n</think>\n\n{call('real')}", "Done."],
                      reasoning_parser="deepseek_r1")
    assert tool_messages(out) == ["real"]
    assert out.metrics["tool_calls_in_reasoning_ignored"] == 1


async def test_prompt_that_opens_think_makes_an_unclosed_turn_all_reasoning():
    tokenizer = load_tiny_tokenizer()
    prompt = "'<|im_start|>assistant\\n' }}{%- endif %}"
    assert prompt in tokenizer.chat_template
    tokenizer.chat_template = tokenizer.chat_template.replace(prompt, "'<|im_start|>assistant\\n<think>\\n' }}{%- endif %}")
    out, server = await run_loop(tokenizer, [f"Still thinking {call('drafted')}"], reasoning_parser="qwen3")
    assert tool_messages(out) == []
    assert out.extra_fields["termination_reason"] == "no_tool_call"
    assert out.metrics["reasoning_unclosed"] == 1
    assert out.metrics["tool_calls_in_reasoning_ignored"] == 1
    assert len(server.calls) == 1
    # Without being told, qwen3 reads the same turn as content (no tags at all): the call runs.
    out, _ = await run_loop(load_tiny_tokenizer(), [f"Still thinking {call('drafted')}", "Done."], reasoning_parser="qwen3")
    assert tool_messages(out) == ["drafted"]


async def test_qwen3_real_template_trajectory():
    path = SHARED_TEMPLATES / "Qwen-Qwen3-0.6B.jinja"
    if not path.exists():
        pytest.skip(f"{path} is absent (the shared chat templates are not in this checkout)")
    tokenizer = tiny_tokenizer_for_template(path)
    out, _ = await run_loop(tokenizer, [QWEN3_TURN, "<think>\nok\n</think>\n\nDone."], reasoning_parser="qwen3")
    assert tool_messages(out) == ["real"]
    assert out.metrics["reasoning_turns"] == 2
    assert out.metrics.get("tokenization_mismatch", 0) == 0


def test_config_errors_name_the_key():
    tokenizer = load_tiny_tokenizer()
    server = ScriptedServer(lambda *a: [], eos_token_id=tokenizer.eos_token_id, append_eos=True)
    with pytest.raises(KeyError, match="unknown reasoning parser 'nope'"):
        ToolAgentLoop(server, tokenizer, {"tools": {"echo": echo}, "reasoning_parser": "nope"})
    with pytest.raises(ValueError, match="multi_turn.tool_parser: gpt_oss"):
        ToolAgentLoop(server, tokenizer, {"tools": {"echo": echo}, "reasoning_parser": "gpt_oss"})


async def test_gpt_oss_analysis_is_reasoning_and_the_commentary_call_runs():
    path = SHARED_TEMPLATES / "openai-gpt-oss-120b.jinja"
    if not path.exists():
        pytest.skip(f"{path} is absent (the shared chat templates are not in this checkout)")
    tokenizer = tiny_tokenizer_for_template(path)
    turn = ('<|channel|>analysis<|message|>Echo it.<|end|><|start|>assistant to=functions.echo'
            '<|channel|>commentary json<|message|>{"text": "real"}<|call|>')
    out, _ = await run_loop(tokenizer, [turn, "<|channel|>final<|message|>Done.<|return|>"], tool_parser="gpt_oss",
                            reasoning_parser="gpt_oss", sanity_check="strict")
    assert tool_messages(out) == ["real"]
    assert out.metrics["reasoning_turns"] == 1
    assert out.metrics["reasoning_chars"] == len("Echo it.")
    assert out.metrics["tool_calls_in_reasoning"] == 0


async def test_qwen3_coder_calls_run_outside_the_reasoning():
    def xml(text: str) -> str:
        return f"<tool_call>\n<function=echo>\n<parameter=text>\n{text}\n</parameter>\n</function>\n</tool_call>"

    turn = f"<think>\nor {xml('drafted')}\n</think>\n\n{xml('real')}"
    out, _ = await run_loop(load_tiny_tokenizer(), [turn, "Done."], tool_parser="qwen3_coder", reasoning_parser="qwen3")
    assert tool_messages(out) == ["real"]
    assert out.metrics["tool_calls_in_reasoning_ignored"] == 1
