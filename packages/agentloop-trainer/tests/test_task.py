"""The synthetic calculator task and its reward."""

from __future__ import annotations

import random

from agentloop_trainer.reward import answer_reward, extract_answer
from agentloop_trainer.task import (
    BIASED_TEMPLATES,
    TEMPLATES,
    demonstration,
    evaluate_expression,
    flip_last_operator,
    make_problems,
)


def test_problems_are_reproducible_and_correct():
    a, b = make_problems(300, 11), make_problems(300, 11)
    assert a == b
    assert a != make_problems(300, 12)
    assert {p.template for p in a} == set(range(len(TEMPLATES)))
    for p in a:
        assert p.answer == evaluate_expression(p.expression) >= 0
        assert all(tok in p.question for tok in p.expression.replace("(", " ").replace(")", " ").split() if tok.isdigit())


def test_teacher_bias_only_on_biased_templates():
    rng = random.Random(0)
    wrong = {t: 0 for t in range(len(TEMPLATES))}
    total = {t: 0 for t in range(len(TEMPLATES))}
    for p in make_problems(2000, 3):
        final = demonstration(p, rng)[-1]["content"]
        total[p.template] += 1
        wrong[p.template] += answer_reward(final, p.answer) == 0.0
    for t in range(len(TEMPLATES)):
        rate = wrong[t] / total[t]
        if t in BIASED_TEMPLATES:
            assert 0.5 < rate < 0.7, (t, rate)
        else:
            assert rate == 0.0, (t, rate)


def test_flip_last_operator():
    assert flip_last_operator("3 + 4 - 2") == "3 + 4 + 2"
    assert flip_last_operator("(3 + 4) / 7") == "(3 - 4) / 7"
    assert flip_last_operator("3 * 4") == "3 * 4"


def test_answer_reward():
    assert extract_answer("blah #### 12\n#### 1,234") == "1234"
    assert answer_reward("#### 42", "42") == 1.0
    assert answer_reward("#### 42.0", 42) == 1.0
    assert answer_reward("#### 41", "42") == 0.0
    assert answer_reward("the answer is 42", "42") == 0.0
