"""Token-budgeted tool responses (``max_tool_response_tokens``): :func:`truncate_tokens` on the
tiny tokenizer and on every tokenizer folder listed in AGENTLOOP_TOKENIZER_DIRS (colon-separated;
e.g. a SmolLM2-135M-Instruct folder), and the budget applied by the ``tool_agent`` loop.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agentloop_core.testing import ScriptedServer, load_tiny_tokenizer
from agentloop_tools.agent_loop import ToolAgentLoop
from agentloop_tools.base import BaseTool
from agentloop_tools.loop_config import ToolAgentConfig
from agentloop_tools.schema import ToolResponse
from agentloop_tools.truncation import TRUNCATION_MARKER, cut_tool_response, truncate_text, truncate_tokens

SIDES = ["left", "right", "middle"]


def _tokenizer_params() -> list:
    folders = [f for f in os.environ.get("AGENTLOOP_TOKENIZER_DIRS", "").split(":") if f]
    params = [pytest.param("tiny", id="tiny")]
    params += [pytest.param(f, id=Path(f).name) for f in folders]
    if not folders:
        params.append(pytest.param(None, id="real", marks=pytest.mark.skip(
            reason="no real tokenizer: set AGENTLOOP_TOKENIZER_DIRS to a Hugging Face folder (e.g. SmolLM2-135M-Instruct)")))
    return params


_LOADED: dict[str, Any] = {}


@pytest.fixture(params=_tokenizer_params(), scope="module")
def tok(request):
    source = request.param
    if source not in _LOADED:
        if source == "tiny":
            _LOADED[source] = load_tiny_tokenizer()
        else:
            if not Path(source).is_dir():
                pytest.fail(f"AGENTLOOP_TOKENIZER_DIRS lists {source}, which is not a folder")
            from transformers import AutoTokenizer

            _LOADED[source] = AutoTokenizer.from_pretrained(source)
    return _LOADED[source]


def count(tok, text: str) -> int:
    return len(tok.encode(text, add_special_tokens=False))


def kept_ends(text: str, cut: str, side: str) -> tuple[str, str]:
    """The head and tail ``cut`` kept of ``text`` (split at the one marker)."""
    head, marker, tail = cut.partition(TRUNCATION_MARKER) if TRUNCATION_MARKER in cut else (cut, "", "")
    if not marker:  # the marker did not fit: the cut keeps one end (middle: the head)
        return ("", cut) if side == "left" else (cut, "")
    return head, tail


TEXT = ("Ann has 3 apples, héllo wörld 日本語 🎉 <tool_call> tabs\t\tand\nnewlines  " * 50)


@pytest.mark.parametrize("side", SIDES)
@pytest.mark.parametrize("budget", [1, 3, 7, 20, 64])
def test_cut_fits_the_budget_and_keeps_the_right_ends(tok, side, budget):
    cut = truncate_tokens(TEXT, budget, side, tok)
    assert count(tok, cut) <= budget
    head, tail = kept_ends(TEXT, cut, side)
    assert TEXT.startswith(head)
    assert TEXT.endswith(tail)
    if side == "left":
        assert head == ""
    if side == "right":
        assert tail == ""
    if budget >= 20:  # room for the marker and text on the kept side(s)
        assert TRUNCATION_MARKER in cut
        assert (head if side != "left" else tail) != ""
        if side == "middle":
            assert head
            assert tail
        # Nearly the whole budget is used: cut tokens are only lost at the joins.
        assert count(tok, cut) >= budget - 4


def test_text_within_the_budget_is_returned_unchanged(tok):
    n = count(tok, TEXT)
    for side in SIDES:
        assert truncate_tokens(TEXT, n, side, tok) is TEXT
        assert count(tok, truncate_tokens(TEXT, n - 1, side, tok)) <= n - 1


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(min_size=0, max_size=300), budget=st.integers(1, 60), side=st.sampled_from(SIDES))
def test_any_unicode_text_and_budget(tok, text, budget, side):
    cut = truncate_tokens(text, budget, side, tok)
    assert count(tok, cut) <= budget
    if count(tok, text) <= budget:
        assert cut == text
    else:
        head, tail = kept_ends(text, cut, side)
        assert text.startswith(head)
        assert text.endswith(tail)
        assert len(head) + len(tail) < len(text)


def test_a_10_mb_response_is_cut_from_windows_at_its_ends(tok):
    big = "0123456789 abc\n" * 700_000  # ~10 MB
    for side in SIDES:
        cut = truncate_tokens(big, 100, side, tok)
        assert count(tok, cut) <= 100
        head, tail = kept_ends(big, cut, side)
        assert big.startswith(head)
        assert big.endswith(tail)
        assert len(head) + len(tail) > 50


def test_both_limits_apply_and_say_which_cut(tok):
    text = "word " * 400  # 2000 characters
    only_chars = cut_tool_response(text, "right", max_length=100, max_tokens=10_000, tokenizer=tok)
    assert only_chars == (truncate_text(text, 100, "right"), True, False)
    only_tokens = cut_tool_response(text, "right", max_length=None, max_tokens=10, tokenizer=tok)
    assert only_tokens.text == truncate_tokens(text, 10, "right", tok)
    assert not only_tokens.by_length
    assert only_tokens.by_tokens
    budget = count(tok, truncate_text(text, 100, "middle")) - 3  # the character cut leaves too many
    assert budget > count(tok, TRUNCATION_MARKER)
    both = cut_tool_response(text, "middle", max_length=100, max_tokens=budget, tokenizer=tok)
    assert both.by_length
    assert both.by_tokens
    assert count(tok, both.text) <= budget
    assert both.text.count(TRUNCATION_MARKER) == 1  # the token cut removed the first marker's surroundings
    neither = cut_tool_response(text, "left", max_length=None, max_tokens=None)
    assert neither == (text, False, False)
    with pytest.raises(ValueError, match="tokenizer"):
        cut_tool_response(text, "left", max_length=None, max_tokens=5)


@pytest.mark.parametrize("key", ["max_tool_response_tokens", "max_tool_response_length"])
@pytest.mark.parametrize("bad", [0, -3, 2.5, "10", True])
def test_limits_are_positive_integers_or_none(key, bad):
    with pytest.raises(ValueError, match=f"{key} must be a positive integer or None"):
        ToolAgentConfig.from_mapping({key: bad})
    assert getattr(ToolAgentConfig(**{key: None}), key) is None
    assert getattr(ToolAgentConfig.from_mapping({key: 7}), key) == 7


class BigTool(BaseTool):
    """Returns ``size`` bytes of digits and words, whatever it is asked."""

    def __init__(self, size: int) -> None:
        super().__init__({}, {"type": "function", "function": {"name": "big", "description": "a big tool",
                                                                "parameters": {"type": "object", "properties": {}}}})
        self.size = size

    async def execute(self, instance_id, parameters):
        return ToolResponse(text=("0123456789 abc\n" * (self.size // 15 + 1))[: self.size]), 0.0, {}


def _tool_turn_tokens(out) -> int:
    """Tokens of the first mask-0 run of the response: the tool message the loop appended."""
    mask = out.response_mask
    start = mask.index(0)
    end = mask.index(1, start) if 1 in mask[start:] else len(mask)
    return end - start


async def _run(tokenizer, size: int, **config: Any):
    call = "<tool_call>\n" + json.dumps({"name": "big", "arguments": {}}) + "\n</tool_call>"
    turns = [call, "done"]
    server = ScriptedServer(lambda rid, ids, i: tokenizer.encode(turns[min(i, 1)], add_special_tokens=False),
                            eos_token_id=tokenizer.eos_token_id, append_eos=True)
    loop = ToolAgentLoop(server, tokenizer, {"tools": {"big": BigTool(size)}, "response_length": 4096,
                                             "max_tool_response_length": None, **config})
    return await loop.run({"temperature": 0.0, "logprobs": True},
                          raw_prompt=[{"role": "user", "content": "call big"}])


@pytest.mark.parametrize("side", SIDES)
async def test_a_10_mb_tool_response_is_cut_to_the_budget_in_the_trajectory(side):
    tokenizer = load_tiny_tokenizer()
    budget = 200
    # The chat template's wrapping of a tool message (role header, end token, next turn's
    # prompt): measured on a response that needs no cut.
    small = await _run(tokenizer, 30, max_tool_response_tokens=budget)
    small_text = next(m["content"] for m in small.extra_fields["messages"] if m["role"] == "tool")
    wrapping = _tool_turn_tokens(small) - count(tokenizer, small_text)

    out = await _run(tokenizer, 10_000_000, max_tool_response_tokens=budget, tool_response_truncate_side=side)
    text = next(m["content"] for m in out.extra_fields["messages"] if m["role"] == "tool")
    assert TRUNCATION_MARKER in text
    assert count(tokenizer, text) <= budget
    # The tokens that entered the trajectory: the budget plus the same wrapping (a token of
    # slack where the content's edge merges differently inside the template).
    assert _tool_turn_tokens(out) <= budget + wrapping + 1
    assert out.metrics["tool_responses_truncated_tokens"] == 1
    assert out.metrics["tool_responses_truncated_length"] == 0
    assert small.metrics["tool_responses_truncated_tokens"] == 0
