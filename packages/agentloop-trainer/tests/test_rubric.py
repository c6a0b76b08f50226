"""``reward.judge.rubric``: criteria with weights, each scored by the judge; the reward is their
weighted mean (each mapped by ``score_range``) and each criterion is a metric ``judge/<name>``.

The checks and the arithmetic on fixed values, the single-mode parser on fixed replies, and the
scorer against a loopback judge that answers with chosen JSON.
"""

from __future__ import annotations

import asyncio
import json

import pytest
import test_group_judge

from agentloop_trainer.config import ConfigError, load_config
from agentloop_trainer.reward.judge import JudgeSettings
from agentloop_trainer.reward.judge_client import judge_step_metrics
from agentloop_trainer.reward.rubric import Criterion, check_rubric, criteria_text, rubric_score
from agentloop_trainer.reward.scoring import RewardScorer

ROW, _Tok = test_group_judge.ROW, test_group_judge._Tok
text_judge = test_group_judge.text_judge
"""A loopback judge that replies what the test chooses."""

RUBRIC = ("reward.judge.rubric=[{name: correct, description: The answer matches the reference, weight: 3},"
          "{name: concise, description: No needless words}]")


def _settings(url: str, *overrides: str) -> JudgeSettings:
    settings = JudgeSettings.from_section(load_config(
        ["reward.judge.enable=true", f"reward.judge.url={url}", RUBRIC, *overrides]).reward.judge)
    assert settings is not None
    return settings


def test_check_rubric_refuses_what_cannot_be_scored():
    assert check_rubric(None) == ()
    assert check_rubric([{"name": "a", "description": " x ", "weight": 2}]) == (Criterion("a", "x", 2.0),)
    for entries, why in [
        ([], "is empty: give at least one"),
        ([{"name": "a", "description": "x", "weight": 0}], r"\[0\].weight must be a finite number > 0"),
        ([{"name": "a", "description": "x", "weight": -1}], "weight must be a finite number > 0"),
        ([{"name": "a", "description": "x", "weight": float("nan")}], "weight must be a finite number > 0"),
        ([{"name": "a", "description": "x", "weight": True}], "weight must be a finite number > 0"),
        ([{"name": "a b", "description": "x"}], r"\[0\].name must be an identifier"),
        ([{"description": "x"}], "name must be an identifier"),
        ([{"name": "calls", "description": "x"}], "taken by the judge's cost metric judge/calls"),
        ([{"name": "a", "description": "x"}, {"name": "a", "description": "y"}], r"\[1\].name 'a' is used twice"),
        ([{"name": "a", "description": " "}], r"\[0\].description must say what the judge scores"),
    ]:
        with pytest.raises(ValueError, match=why):
            check_rubric(entries)


def test_weighted_mean_of_mapped_scores():
    rubric = check_rubric([{"name": "a", "description": "x", "weight": 3}, {"name": "b", "description": "y"}])
    assert criteria_text(rubric) == "- a: x\n- b: y"
    score, parts = rubric_score({"a": 10, "b": "5", "why": "fine"}, rubric, (0.0, 10.0))
    assert parts == {"a": 1.0, "b": 0.5}
    assert score == pytest.approx((3 * 1.0 + 1 * 0.5) / 4)
    assert rubric_score({"a": 4, "b": -2}, rubric, None) == (pytest.approx(2.5), {"a": 4.0, "b": -2.0})
    for scores, why in [({"a": 1}, r"no score for criteria \['b'\]"), ({"a": 11, "b": 0}, "outside"),
                        ([1, 2], "expected an object of criterion scores"), ({"a": None, "b": 1}, "not a number")]:
        with pytest.raises(ValueError, match=why):
            rubric_score(scores, rubric, (0.0, 10.0))


def test_single_mode_reply_and_config_errors():
    s = _settings("policy")
    assert "{criteria}" in s.prompt  # the built-in rubric prompt
    assert "{response}" in s.prompt
    score, parts = s.parse_verdict('I think... {"scores": {"correct": 10, "concise": 2}}')
    assert (score, parts) == (pytest.approx(0.8), {"correct": 1.0, "concise": pytest.approx(0.2)})
    assert s.parse_verdict('{"correct": 0, "concise": 10}')[0] == pytest.approx(0.25)  # without "scores"
    with pytest.raises(ValueError, match="no JSON object of criterion scores"):
        s.parse_verdict("Score: 7")
    base = ["reward.judge.enable=true", "reward.judge.url=http://127.0.0.1:1/v1"]
    for overrides, why in [
        (["reward.judge.rubric=[]"], "reward.judge.rubric is empty"),
        (["reward.judge.rubric=[{name: a, description: b, weight: 0}]"], r"reward.judge.rubric\[0\].weight"),
        ([RUBRIC, "reward.judge.prompt='Grade {response}'"], r"put \{criteria\} in it"),
        (["reward.judge.prompt='Grade {response} on {criteria}'"], r"names \['criteria'\]"),
    ]:
        with pytest.raises(ConfigError, match=why):
            load_config([*base, *overrides])


def test_scorer_reports_each_criterion(text_judge):
    from agentloop_core.batch import RolloutBatch
    from agentloop_core.output import AgentLoopOutput

    replies = iter(['{"scores": {"correct": 10, "concise": 4}}', '{"scores": {"correct": 0, "concise": 8}}'])
    judge = text_judge(lambda prompt: (200, next(replies)))
    scorer = RewardScorer(judge=_settings(judge.url))
    outputs = []
    for t in range(2):
        text = "#### 4"
        out = AgentLoopOutput(prompt_ids=[1], response_ids=[ord(c) for c in text], response_mask=[1] * len(text),
                              response_logprobs=None, num_turns=1)
        out.trajectory_index, out.segment_index = t, 0
        asyncio.run(scorer(out, ROW, _Tok()))
        outputs.append(out)
    assert "- correct: The answer matches the reference\n- concise: No needless words" in judge.prompts[0]
    assert outputs[0].reward_score == pytest.approx((3 * 1.0 + 0.4) / 4)
    assert outputs[0].metrics["judge/correct"] == 1.0
    assert outputs[0].metrics["judge/concise"] == pytest.approx(0.4)
    assert outputs[1].reward_score == pytest.approx(0.8 / 4)
    metrics = judge_step_metrics(RolloutBatch.from_outputs(outputs, pad_token_id=0))
    assert metrics["judge/calls"] == 2.0  # summed
    assert metrics["judge/correct"] == pytest.approx(0.5)  # averaged over the step's samples
    assert metrics["judge/concise"] == pytest.approx(0.6)
    assert json.dumps(metrics)  # plain floats: the logger writes them
