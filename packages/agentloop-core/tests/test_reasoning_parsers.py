"""Reasoning parsers (``qwen3``, ``deepseek_r1``, ``gpt_oss``): the split per family, the registry,
and the split of what the families' real chat templates render (``../shared``; skipped when absent)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from agentloop_core.reasoning import (
    DeepSeekR1ReasoningParser,
    GptOssReasoningParser,
    Qwen3ReasoningParser,
    ReasoningSplit,
    UnknownReasoningParserError,
    get_reasoning_parser,
    reasoning_parser_names,
    register_reasoning_parser,
)

# AGENTLOOP_CHAT_TEMPLATES points at the folder from a checkout that is not beside ../shared.
SHARED_TEMPLATES = Path(os.environ.get("AGENTLOOP_CHAT_TEMPLATES")
                        or Path(__file__).resolve().parents[3].parent / "shared" / "data" / "chat_templates")
CALL = '<tool_call>\n{"name": "calc", "arguments": {"expr": "1+1"}}\n</tool_call>'


def test_registry_names_aliases_and_errors():
    assert {"qwen3", "qwq", "deepseek_r1", "gpt_oss", "harmony"} <= set(reasoning_parser_names())
    assert isinstance(get_reasoning_parser("qwen3"), Qwen3ReasoningParser)
    assert get_reasoning_parser("qwq") is get_reasoning_parser("qwen3")
    assert get_reasoning_parser("harmony") is get_reasoning_parser("gpt_oss")
    assert get_reasoning_parser("deepseek_r1").name == "deepseek_r1"
    with pytest.raises(UnknownReasoningParserError, match=r"unknown reasoning parser 'nope'.*qwen3.*reasoning_parser"):
        get_reasoning_parser("nope")
    with pytest.raises(ValueError, match="already registered"):
        register_reasoning_parser("qwen3")(DeepSeekR1ReasoningParser)


@pytest.mark.parametrize(("text", "in_reasoning", "reasoning", "content", "closed"), [
    (f"<think>\nI could {CALL} here.\n</think>\n\nSure. {CALL}", False, f"I could {CALL} here.", f"\n\nSure. {CALL}", True),
    (f"no reasoning {CALL}", False, "", f"no reasoning {CALL}", True),
    # The template opened <think>: the turn begins inside it, told or not.
    (f"thinking {CALL}\n</think>\n\nanswer", True, f"thinking {CALL}", "\n\nanswer", True),
    (f"thinking {CALL}\n</think>\n\nanswer", False, f"thinking {CALL}", "\n\nanswer", True),
    (f"opened and told, no close {CALL}", True, f"opened and told, no close {CALL}", "", False),
    (f"text <think>never closed {CALL}", False, f"never closed {CALL}", "text ", False),
    ("<think>a</think>b<think>c</think>d", False, "a\nc", "bd", True),
    ("<think>\n\n</think>\n\nplain", False, "", "\n\nplain", True),  # enable_thinking=False's empty block
])
def test_qwen3_split(text, in_reasoning, reasoning, content, closed):
    assert Qwen3ReasoningParser().split(text, in_reasoning=in_reasoning) == ReasoningSplit(reasoning, content, closed)


@pytest.mark.parametrize(("text", "reasoning", "content", "closed"), [
    (f"I will call {CALL}\n</think>\n\nDone. {CALL}", f"I will call {CALL}", f"\n\nDone. {CALL}", True),
    (f"<think>\nwith the tag\n</think>\n{CALL}", "with the tag", f"\n{CALL}", True),
    (f"no close tag {CALL}", f"no close tag {CALL}", "", False),  # R1 always thinks first
])
def test_deepseek_r1_split(text, reasoning, content, closed):
    assert DeepSeekR1ReasoningParser().split(text) == ReasoningSplit(reasoning, content, closed)


def test_qwen3_and_r1_differ_on_a_turn_without_tags():
    assert Qwen3ReasoningParser().split(CALL).content == CALL
    assert DeepSeekR1ReasoningParser().split(CALL).content == ""


@pytest.mark.parametrize(("prompt_tail", "expected"), [
    ("<|im_start|>assistant\n", False),
    ("<|im_start|>assistant\n<think>\n", True),
    ("<|im_start|>assistant\n<think>\n\n</think>\n\n", False),
])
def test_qwen3_reads_the_prompt_and_r1_always_starts_inside(prompt_tail, expected):
    assert Qwen3ReasoningParser().starts_in_reasoning(prompt_tail) is expected
    assert DeepSeekR1ReasoningParser().starts_in_reasoning(prompt_tail) is True


ANALYSIS = "<|channel|>analysis<|message|>Maybe call functions.calc with {\"expr\": \"1\"}.<|end|>"
COMMENTARY_CALL = '<|start|>assistant<|channel|>commentary to=functions.calc <|constrain|>json<|message|>{"expr": "1+1"}<|call|>'


def test_gpt_oss_split_keeps_calls_and_final_as_written():
    parser = GptOssReasoningParser()
    split = parser.split(ANALYSIS + COMMENTARY_CALL)
    assert split.reasoning == 'Maybe call functions.calc with {"expr": "1"}.'
    assert split.content == COMMENTARY_CALL
    final = "<|start|>assistant<|channel|>final<|message|>It is 2.<|return|>"
    assert parser.split(ANALYSIS + final) == ReasoningSplit(split.reasoning, final, True)
    # An analysis message the turn never closed; a call addressed from the analysis channel
    # (how gpt-oss calls built-in tools) stays a call.
    assert parser.split("<|channel|>analysis<|message|>still thinking") == ReasoningSplit("still thinking", "", False)
    builtin = "<|channel|>analysis to=python code<|message|>print(1)<|call|>"
    assert parser.split(builtin) == ReasoningSplit("", builtin, True)


def test_gpt_oss_content_reparses_to_the_same_calls():
    from agentloop_core.parsers import get_tool_parser

    tool_parser = get_tool_parser("gpt_oss")
    text = ANALYSIS + COMMENTARY_CALL
    assert tool_parser.parse(GptOssReasoningParser().split(text).content, record=False).calls == \
        tool_parser.parse(text, record=False).calls


def _template(name: str) -> str:
    path = SHARED_TEMPLATES / name
    if not path.exists():
        pytest.skip(f"{path} is absent (the shared chat templates are not in this checkout)")
    return path.read_text()


def _render(template: str, messages, **kwargs) -> str:
    from agentloop_core.testing import load_tiny_tokenizer

    return load_tiny_tokenizer().apply_chat_template(messages, chat_template=template, tokenize=False, **kwargs)


def test_qwen3_template_history_and_generation_prompts_split():
    template = _template("Qwen-Qwen3-0.6B.jinja")
    user = {"role": "user", "content": "What is 1+1?"}
    assistant = {"role": "assistant", "content": "It is 2.", "reasoning_content": "One plus one is two."}
    text = _render(template, [user, assistant])
    turn = text.rsplit("<|im_start|>assistant\n", 1)[1].removesuffix("<|im_end|>\n")
    split = Qwen3ReasoningParser().split(turn)
    assert (split.reasoning, split.content.strip()) == ("One plus one is two.", "It is 2.")
    parser = Qwen3ReasoningParser()
    assert not parser.starts_in_reasoning(_render(template, [user], add_generation_prompt=True))
    assert not parser.starts_in_reasoning(_render(template, [user], add_generation_prompt=True, enable_thinking=False))


def test_gpt_oss_template_thinking_splits_back():
    template = _template("openai-gpt-oss-120b.jinja")
    user = {"role": "user", "content": "What is 1+1?"}
    assistant = {"role": "assistant", "content": "It is 2.", "thinking": "One plus one is two."}
    text = _render(template, [user, assistant])
    turn = text.split("What is 1+1?<|end|>", 1)[1].removeprefix("<|start|>assistant")
    split = GptOssReasoningParser().split(turn)
    assert split.reasoning == "One plus one is two."
    assert "It is 2." in split.content
    assert "One plus one" not in split.content
