"""Reading answers out of model text (``reward.answer_format``): real-looking instruct-model
answers right and wrong, strict vs flexible per data_source, and properties of the parser, which
reads hostile input (it never raises, and reads a bounded tail of any text)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agentloop_trainer.reward import (
    MAX_SCAN_CHARS,
    RewardScorer,
    answer_format_for,
    answers_match,
    builtin_scorer,
    check_answer_format,
    find_answer,
    flexible_reward,
    leading_number,
)

# (response, ground truth, flexible reward). Written the way SmolLM2/Qwen-style instruct models
# answer word problems, including the wrong answers they give.
ANSWERS = [
    ("So 56 is the solution.", "56", 1.0),
    ("Tom has 3 apples and buys 4 more, so he has 3 + 4 = 7 apples.\n\nThe answer is 7.", "7", 1.0),
    ("12 + 7 = 9. The answer is 9", "19", 0.0),
    ("12 + 7 = 19. The answer is 19", "19", 1.0),
    ("The answer is 12 + 7 = 19.", "19", 1.0),
    ("Step 1: 6 * 2 = 12\nStep 2: 12 + 3 = 15\nFinal answer: 15", "15", 1.0),
    ("**Answer:** 56 apples", "56", 1.0),
    ("The final answer is $\\boxed{1,234}$.", "1234", 1.0),
    ("Therefore, the total cost is $18.00.\n#### 18", "18", 1.0),
    ("Answer: $18.00", "18", 1.0),
    ("The answer is: **72**.", "72", 1.0),
    ("the answer is 19 (12 + 7). I hope this helps!", "19", 1.0),
    ("I think the answer is 19. Wait, that's wrong. The answer is 9.", "19", 0.0),  # the last answer counts
    ("The answer is 9. Let me check: 12 + 7 = 19. So the answer is 19.", "19", 1.0),
    ("#### 19\n\nActually, the answer is 20.", "19", 0.0),
    ("The solution is to add 12 and 7, which gives 19", "19", 1.0),  # no stated answer: the last number
    ("She has 5 - 8 = -3 dollars left. The answer is -3.", "-3", 1.0),
    ("The answer is 3.5 hours.", "3.5", 1.0),
    ("The answer is 56.0", "56", 1.0),
    ("The answer is 1,000,000.", "1000000", 1.0),
    ("The answer is 1,2,3.", "123", 0.0),  # not a thousands separator
    ("The answer is 3/4.", "0.75", 1.0),
    ("I don't know how to solve this.", "5", 0.0),
    ("", "5", 0.0),
    ("The answer is 7", "#### 7", 1.0),  # a GSM8K solution as the ground truth
    ("<tool_call>\n{\"name\": \"calculator\", \"arguments\": {\"expression\": \"12+7\"}}\n</tool_call>", "19", 0.0),
    ("Therefore, the answer is \\(\\frac{1}{2}\\).", "\\frac{1}{2}", 1.0),
    ("The answer is \\boxed{\\dfrac{1}{2}}", "0.5", 1.0),
    ("The correct option is (B). The answer is (B).", "(B)", 1.0),
    ("The answer is (C).", "(B)", 0.0),
    ("The answer isn't 5, it's 7.", "7", 1.0),  # no stated answer ("isn't" is no cue): the last number
]


@pytest.mark.parametrize(("text", "truth", "expected"), ANSWERS)
def test_flexible_reads_real_looking_answers(text, truth, expected):
    assert flexible_reward(text, truth) == expected, find_answer(text)


@pytest.mark.parametrize(("text", "truth", "expected"), [
    ("So 56 is the solution.", "56", 0.0),  # strict: '#### N' or nothing
    ("The answer is 56.", "56", 0.0),
    ("#### 56", "56", 1.0),
    ("3 + 4 = 7\n#### 7", "7", 1.0),
    ("#### 8", "7", 0.0),
])
def test_strict_gsm8k_reads_only_the_canonical_form(text, truth, expected):
    assert builtin_scorer("openai/gsm8k")("openai/gsm8k", text, truth) == expected
    assert builtin_scorer("agentloop/calculator")("agentloop/calculator", text, truth) == expected


def test_strictness_per_data_source():
    formats = {"default": "strict", "gsm8k": "flexible", "lighteval/MATH": "flexible"}
    assert answer_format_for("openai/gsm8k", formats) == "flexible"  # the tail matches
    assert answer_format_for("agentloop/calculator", formats) == "strict"  # the built-in task stays strict
    assert answer_format_for("lighteval/MATH", formats) == "flexible"
    assert answer_format_for("HuggingFaceH4/MATH-500", formats) == "strict"
    assert answer_format_for("x", {"default": "flexible"}) == "flexible"
    assert answer_format_for("x", None) == "strict"
    gsm = builtin_scorer("openai/gsm8k", formats)
    assert gsm("openai/gsm8k", "So the answer is 56.", "56") == 1.0
    calculator = builtin_scorer("agentloop/calculator", formats)
    assert calculator("agentloop/calculator", "So the answer is 56.", "56") == 0.0
    math = builtin_scorer("HuggingFaceH4/MATH-500", formats)
    assert math("m", "The answer is 7", "7") == 0.0
    assert math("m", "\\boxed{7}", "7") == 1.0
    assert builtin_scorer("user/letters", {"default": "flexible"}) is None  # no built-in scorer, no format
    with pytest.raises(ValueError, match=r"reward.answer_format.*'gsm8k': 'loose'"):
        check_answer_format({"gsm8k": "loose"})
    with pytest.raises(ValueError, match="reward.answer_format"):
        RewardScorer(answer_format={"default": "lenient"})


def test_describe_names_the_format_and_the_key():
    scorer = RewardScorer(answer_format={"default": "strict", "gsm8k": "flexible"})
    assert "reward.answer_format flexible" in scorer.describe("openai/gsm8k")
    assert "reward.answer_format strict (only '#### N')" in scorer.describe("agentloop/calculator")


def test_a_cut_response_has_no_last_number_answer():
    """A response cut by a token limit ends mid-thought: its last number is an intermediate one,
    so only an answer it states counts (the RewardScorer passes ``truncated`` from the loop's
    stop counters)."""
    cut = "First, the cards on both days: 12 * 2 = 24 cards.\nThen, we calculate the"
    assert flexible_reward(cut, 24) == 1.0
    assert flexible_reward(cut, 24, truncated=True) == 0.0
    stated = "The answer is 24. Let me check: 12 * 2 is"
    assert flexible_reward(stated, 24, truncated=True) == 1.0

    import asyncio

    from agentloop_core.output import AgentLoopOutput
    from agentloop_core.stops import TURN_CAP

    class Tok:
        def decode(self, ids, skip_special_tokens=True):
            return cut

    scorer = RewardScorer(answer_format={"default": "flexible"})
    row = {"data_source": "openai/gsm8k", "ground_truth": "24"}
    for capped, expected in ((0, 1.0), (1, 0.0)):
        out = AgentLoopOutput(prompt_ids=[1], response_ids=[5], response_mask=[1], metrics={TURN_CAP: capped})
        asyncio.run(scorer(out, row, Tok()))
        assert out.reward_score == expected


def test_leading_number():
    assert leading_number("56 apples") == 56
    assert leading_number("$1,234.50") == 1234.5
    assert leading_number("x = -5") == -5
    assert leading_number("approximately 3.14") == 3.14
    assert leading_number("12 + 7") is None
    assert leading_number("12 + 7 = 19") == 19
    assert leading_number("\u22125") == -5
    assert leading_number("no number") is None
    assert answers_match("56 \\text{ apples}", 56)
    assert not answers_match("57", 56)


# -- properties ------------------------------------------------------------------------------

_PIECES = st.sampled_from(["####", "\\boxed{", "\\boxed", "}", "{", "$", "**", "answer is", "Answer:", "=",
                           "the final answer is", " ", "\n", ".", ",", "-", "1", "23", "4,567", "8.9", "\u2212",
                           "\\(", "\\)", "\\text{", "x =", "apples", "(", ")", "/", "0" * 40])
_HOSTILE = st.lists(st.one_of(_PIECES, st.text(max_size=8)), max_size=60).map("".join)


@settings(max_examples=300, deadline=None)
@given(text=st.one_of(st.text(), _HOSTILE), truth=st.one_of(st.text(max_size=10), st.integers(), st.floats()))
def test_never_raises(text, truth):
    found = find_answer(text)
    assert found is None or (found.text == found.text.strip() and 0 <= found.position < len(text))
    assert flexible_reward(text, truth) in (0.0, 1.0)
    for fn in (builtin_scorer("gsm8k"), builtin_scorer("math")):
        assert fn("x", text, truth) in (0.0, 1.0)


@settings(max_examples=200, deadline=None)
@given(n=st.integers(-10**9, 10**9), prefix=_HOSTILE,
       tail=st.text(alphabet=" abcdefghijklmnopqrstuvwxyz!", max_size=40))
def test_a_stated_answer_is_read_whatever_comes_before_and_after(n, prefix, tail):
    # A closing brace ends any box the prefix left open; prose after the answer does not change it.
    text = f"{prefix}}}\nThe answer is {n:,}.{tail}"
    assert flexible_reward(text, n) == 1.0, find_answer(text)
    assert flexible_reward(text, n + 1) == 0.0


@settings(max_examples=100, deadline=None)
@given(n=st.integers(0, 10**7), form=st.sampled_from(["{:,}", "${:,}", "{}.0", "{} apples", "**{}**", "\\boxed{{{}}}",
                                                       "#### {}", "${}$", "{:,}.00 dollars"]))
def test_number_spellings_match(n, form):
    assert flexible_reward(f"So the answer is {form.format(n)}", n) == 1.0
    assert flexible_reward(f"So the answer is {form.format(n + 1)}", n) == 0.0


@pytest.mark.parametrize("piece", ["answer is ", "\\boxed{", "#### ", "1" * 50 + " ", "{" * 10, "x = 1 + ", "$"])
def test_long_hostile_texts_read_only_a_bounded_tail(piece):
    """A megabyte of one repeated piece: the parser finishes (it reads the last MAX_SCAN_CHARS
    characters with linear patterns), and what precedes that tail cannot change the answer."""
    tail = (piece * (MAX_SCAN_CHARS // len(piece) + 1))[-MAX_SCAN_CHARS:]
    text = piece * (1_000_000 // len(piece))
    assert find_answer("The answer is 5. " + text[:-MAX_SCAN_CHARS] + tail) == find_answer(tail)
    flexible_reward(text, 5)  # finishes, whatever it finds
    builtin_scorer("math")("math", text, "5")
    builtin_scorer("gsm8k")("gsm8k", text, "5")
