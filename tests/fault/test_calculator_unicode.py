"""Careless and hostile calculator input over the whole of unicode: every string either
evaluates to a bounded number or raises ``CalculatorError`` (which the model reads as
``Error: ...``), never another exception that would crash the tool call."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agentloop_tools.builtin import CalculatorError, CalculatorLimits, evaluate_expression

# exclude_categories=() lets in what st.text() leaves out by default: lone surrogates (Cs). The
# categories that look like arithmetic to a model (digits and numbers of other scripts, marks,
# controls, spaces, math symbols) are drawn more often than their share of the code space.
_any_char = st.one_of(st.characters(exclude_categories=()),
                      st.characters(categories=["Cs", "Nd", "No", "Nl", "Mn", "Cc", "Cf", "Zs", "Zl", "Sm"]))
_arith_char = st.sampled_from(list("0123456789+-*/%(). e"))

CORPUS = [
    "\ud800", "1+\udfff", "\udbff\udc00", "1\x002", "\x00", "２+２", "2²", "²", "١+١", "𝟐+𝟑", "½", "Ⅻ",
    "1\u0301+1", "\u0301", "1e999", "1e99999999999999999999", "9" * 256, "1" + "\u200b" + "2", "\ufeff1",
    "1\u00a0+1", "1\u2028+1", "\x0c1", "1\x0b+1", "∞", "1\N{MINUS SIGN}1", "1×2", "4÷2", "\U0010ffff",
    "(" * 200 + "1" + ")" * 200, "-" * 255 + "1", "ᐅ", "ｘ", "𝑥", "_", "__import__", "1_000", "0b1e1",
]


def _bounded_or_calculator_error(text: str) -> None:
    try:
        value = evaluate_expression(text)
    except CalculatorError:
        return
    assert isinstance(value, (int, float))
    assert abs(value) <= CalculatorLimits().max_abs_result


@pytest.mark.parametrize("text", CORPUS, ids=range(len(CORPUS)))
def test_unicode_corpus(text):
    _bounded_or_calculator_error(text)


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.text(_any_char, max_size=300))
def test_any_unicode_text(text):
    _bounded_or_calculator_error(text)


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.one_of(_arith_char, _any_char), max_size=60).map("".join))
def test_arithmetic_salted_with_unicode(text):
    # Mostly valid arithmetic with stray characters: reaches the evaluator, not just the parser.
    _bounded_or_calculator_error(text)


def test_the_error_names_the_character():
    with pytest.raises(CalculatorError, match=r"U\+00B2"):
        evaluate_expression("2²")
    with pytest.raises(CalculatorError, match=r"U\+D800"):
        evaluate_expression("1+\ud800")
