"""Rewards: built-in scorers by data_source, verl-signature reward files, reward.source."""

from __future__ import annotations

import asyncio

import pytest

from agentloop_core.output import AgentLoopOutput
from agentloop_trainer.reward import (
    RewardScorer,
    boxed_reward,
    builtin_scorer,
    load_reward_function,
    normalize_math_answer,
    split_score,
)


@pytest.mark.parametrize(("text", "truth", "expected"), [
    (r"so \boxed{42}", "42", 1.0),
    (r"\boxed{\frac{1}{2}}", "0.5", 1.0),
    (r"\boxed{\dfrac12}", r"\frac{1}{2}", 1.0),
    (r"\boxed{x = 3}", "3", 1.0),
    (r"\boxed{1,000}", "1000", 1.0),
    (r"\boxed{\text{(B)}}", "(B)", 1.0),
    (r"\boxed{\left( 1, 2 \right)}", "(1,2)", 1.0),
    (r"first \boxed{3} then \boxed{4}", "4", 1.0),
    (r"\boxed{41}", "42", 0.0),
    ("42", "42", 0.0),  # no box, no reward: the format is part of the task
    (r"\boxed{\sqrt{2}}", r"\boxed{\sqrt{2}}", 1.0),
    (r"\boxed{12", "12", 0.0),  # unbalanced
])
def test_boxed_reward(text, truth, expected):
    assert boxed_reward(text, truth) == expected


def test_normalize_math_answer():
    assert normalize_math_answer(r" \$5.  ") == normalize_math_answer("5")
    assert normalize_math_answer(r"90^\circ") == "90"


def test_builtin_scorer_by_data_source():
    assert builtin_scorer("openai/gsm8k")("openai/gsm8k", "#### 7", "7") == 1.0
    assert builtin_scorer("my-org/gsm8k")("x", "#### 7", "7") == 1.0  # the name's tail matches
    assert builtin_scorer("HuggingFaceH4/MATH-500")("x", r"\boxed{7}", "7") == 1.0
    assert builtin_scorer("user/letters") is None
    assert builtin_scorer(None) is None


def test_split_score():
    assert split_score(0.5, "f") == (0.5, {})
    assert split_score({"score": 1, "acc": True, "note": "x"}, "f") == (1.0, {"acc": 1.0})
    with pytest.raises(ValueError, match="f returned a dict without 'score'"):
        split_score({"acc": 1}, "f")
    for bad in ("1", None, float("nan"), True):
        with pytest.raises(ValueError, match="f returned"):
            split_score(bad, "f")


def test_load_reward_function_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="custom_reward_function.path"):
        load_reward_function(tmp_path / "missing.py")
    f = tmp_path / "r.py"
    f.write_text("def other(a, b, c, d):\n    return 0\n")
    with pytest.raises(ValueError, match=r"has no function 'compute_score'.*\['other'\]"):
        load_reward_function(f)
    f2 = tmp_path / "r2.py"
    f2.write_text("def compute_score(solution_str):\n    return 0\n")
    with pytest.raises(ValueError, match="must accept"):
        load_reward_function(f2)


class _Tok:
    def decode(self, ids, skip_special_tokens=True):
        return " ".join(str(i) for i in ids)


def _out(loop_reward):
    return AgentLoopOutput(prompt_ids=[1], response_ids=[7, 8, 9], response_mask=[1, 0, 1],
                           reward_score=loop_reward)


def _score(scorer, row, loop_reward=None):
    out = _out(loop_reward)
    asyncio.run(scorer(out, row, _Tok()))
    return out


def test_reward_sources(tmp_path):
    f = tmp_path / "r.py"
    f.write_text("async def compute_score(data_source, solution_str, ground_truth, extra_info, bonus=0):\n"
                 "    return {'score': float(solution_str == '7 9') + bonus, 'seen': len(solution_str)}\n")
    row = {"data_source": "user/x", "reward_model": {"ground_truth": "x"}, "extra_info": {}}
    fn = {"path": str(f), "reward_kwargs": {"bonus": 1}}
    # Only mask-1 tokens reach the function (8 is a tool token).
    assert _score(RewardScorer("function", **fn), row, 5.0).reward_score == 2.0
    out = _score(RewardScorer("sum", **fn), row, 5.0)
    assert out.reward_score == 7.0
    assert out.metrics["reward/seen"] == 3.0
    assert _score(RewardScorer("loop"), row, 5.0).reward_score == 5.0
    assert _score(RewardScorer("auto"), row, 5.0).reward_score == 5.0  # no function for user/x
    with pytest.raises(ValueError, match="no reward for data_source 'user/x'"):
        _score(RewardScorer("auto"), row, None)
    with pytest.raises(ValueError, match="no reward function for data_source 'user/x'"):
        _score(RewardScorer("function"), row, 1.0)


def test_scorer_pickles_without_the_loaded_function(tmp_path):
    import pickle

    f = tmp_path / "r.py"
    f.write_text("def compute_score(a, b, c, d):\n    return 1.0\n")
    scorer = RewardScorer("function", str(f))
    scorer.function_for(None)
    clone = pickle.loads(pickle.dumps(scorer))
    assert clone._fn is None
    assert clone.function_for(None)("s", "x", "y", {}) == 1.0
