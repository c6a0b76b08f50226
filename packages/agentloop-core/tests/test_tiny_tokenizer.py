"""The tiny tokenizer is stable across save/reload and renders the tool-calling template."""

from __future__ import annotations

import json

import pytest

from agentloop_core.testing import tiny_tokenizer, tiny_tokenizer_path
from agentloop_core.testing.tiny_tokenizer import EOS_TOKEN, MARKUP_TOKENS, SPECIAL_TOKENS, VOCAB_SIZE

SAMPLES = [
    "Ann has 12 apples. She buys 3 more and then eats 2. How many apples are left?",
    '<tool_call>\n{"name": "calculator", "arguments": {"expression": "12 + 3"}}\n</tool_call>',
    "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\nok\n</think>\n\nHello",
    "unicode: caf\u00e9 cafe\u0301 \u4e2d\u6587 \U0001f642 tabs\tand  spaces\n\n\nend",
    "",
]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    return tiny_tokenizer_path(tmp_path_factory.mktemp("tok") / "tiny")


def test_ids_survive_save_and_reload(built, tmp_path):
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(built))
    assert type(tok).__name__ == "Qwen2Tokenizer"
    assert len(tok) == VOCAB_SIZE
    tok.save_pretrained(tmp_path / "resaved")
    again = AutoTokenizer.from_pretrained(str(tmp_path / "resaved"))
    raw = Tokenizer.from_file(str(built / "tokenizer.json"))
    for text in SAMPLES:
        ids = tok.encode(text, add_special_tokens=False)
        assert again.encode(text, add_special_tokens=False) == ids
        assert raw.encode(text, add_special_tokens=False).ids == ids
        assert tok.decode(ids, skip_special_tokens=False) == tok.backend_tokenizer.normalizer.normalize_str(
            text
        )
    for special in SPECIAL_TOKENS + MARKUP_TOKENS:
        assert len(tok.encode(special, add_special_tokens=False)) == 1, special
    assert tok.eos_token == EOS_TOKEN


def test_template_renders_tools_calls_and_responses(built):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(built))
    tools = [
        {
            "type": "function",
            "function": {
                "name": "calculator",
                "description": "math",
                "parameters": {"type": "object", "properties": {}},
            },
        }
    ]
    messages = [
        {"role": "user", "content": "2+3?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "2+3"}}}
            ],
        },
        {"role": "tool", "content": "5"},
        {"role": "tool", "content": "ok"},
    ]
    text = tok.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    assert "<tools>\n" + json.dumps(tools[0]) + "\n</tools>" in text
    assert (
        '<|im_start|>assistant\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "2+3"}}\n</tool_call><|im_end|>\n'
        in text
    )
    # Consecutive tool results share one user turn.
    assert (
        "<|im_start|>user\n<tool_response>\n5\n</tool_response>\n<tool_response>\nok\n</tool_response><|im_end|>\n"
        in text
    )
    assert text.endswith("<|im_start|>assistant\n")
    assert tok.chat_template == tiny_tokenizer.chat_template()


def test_build_is_cached(built, monkeypatch):
    marker = built / ".complete"
    stamp = marker.stat().st_mtime_ns

    def no_rebuild(out_dir):
        raise AssertionError("build_once rebuilt a complete tokenizer folder")

    monkeypatch.setattr(tiny_tokenizer, "_build", no_rebuild)
    assert tiny_tokenizer_path(built) == built
    assert marker.stat().st_mtime_ns == stamp
    with pytest.raises(AssertionError, match="rebuilt"):
        tiny_tokenizer_path(built.parent / "elsewhere")  # a new location does build
