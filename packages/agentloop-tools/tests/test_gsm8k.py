"""The GSM8K answer-check tool."""

from decimal import Decimal

import pytest

from agentloop_tools.base import ToolKwargsError
from agentloop_tools.builtin.gsm8k import Gsm8kTool, parse_number


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("42", "42"),
        ("1,234", "1234"),
        ("$5", "5"),
        ("#### 42", "42"),
        ("Step 3 gives 10, so #### 1,000", "1000"),
        ("The answer is -3.50.", "-3.50"),
        (17, "17"),
        ("no number", None),
        (None, None),
    ],
)
def test_parse_number(text, expected):
    assert parse_number(text) == (None if expected is None else Decimal(expected))


async def test_check_answer_checks_one_answer_and_rewards_it_once():
    tool = Gsm8kTool({}, None)
    assert tool.name == "check_answer"
    iid = await tool.create(create_kwargs={"ground_truth": "#### 1,234"})
    resp, reward, metrics = await tool.execute(iid, {"answer": "The total is $1,234.00"})
    assert (reward, resp.text) == (0.0, "Correct.")  # the call earns nothing: calc_reward is the reward
    assert metrics == {"attempts": 1, "refused": 0}
    resp, reward, metrics = await tool.execute(iid, {"answer": "1233"})  # past max_attempts=1: not checked
    assert reward == 0.0
    text = resp.text or ""
    assert "No attempts left" in text
    assert "Incorrect" not in text
    assert "Correct" not in text
    assert metrics == {"attempts": 0, "refused": 1}
    assert await tool.calc_reward(iid) == 1.0
    other = await tool.create(ground_truth=7)  # flat tools_kwargs
    assert await tool.calc_reward(other) == 0.0  # nothing checked


async def test_check_answer_opt_out_retries_and_best_answer():
    tool = Gsm8kTool({"max_attempts": None, "score": "best"}, None)
    iid = await tool.create(create_kwargs={"ground_truth": "#### 1,234"})
    resp, _, _ = await tool.execute(iid, {"answer": "1233"})
    assert "Incorrect" in (resp.text or "")
    resp, _, _ = await tool.execute(iid, {"answer": "1,234"})
    assert resp.text == "Correct."
    await tool.execute(iid, {"answer": "nothing"})  # a later wrong answer keeps the best
    assert await tool.calc_reward(iid) == 1.0
    last = Gsm8kTool({"max_attempts": 3}, None)  # retries, but the last checked answer is the reward
    iid = await last.create(create_kwargs={"ground_truth": "5"})
    await last.execute(iid, {"answer": "5"})
    await last.execute(iid, {"answer": "6"})
    assert await last.calc_reward(iid) == 0.0


@pytest.mark.parametrize(("config", "match"), [({"max_attempts": 0}, "max_attempts"),
                                               ({"max_attempts": True}, "max_attempts"),
                                               ({"score": "max"}, "score must be one of")])
def test_check_answer_config_errors(config, match):
    with pytest.raises(ValueError, match=match):
        Gsm8kTool(config, None)


async def test_missing_ground_truth_is_an_error():
    tool = Gsm8kTool({}, None)
    with pytest.raises(ValueError, match="numeric ground_truth"):
        await tool.create(create_kwargs={})
    with pytest.raises(ValueError, match="unexpected create kwargs"):
        await tool.create(create_kwargs={"ground_truth": 1, "gt": 2})


async def test_calc_reward_kwargs_rescore_against_another_ground_truth():
    tool = Gsm8kTool({"max_attempts": 2, "score": "best"}, None)
    iid = await tool.create(create_kwargs={"ground_truth": "10"}, calc_reward_kwargs={"ground_truth": "#### 12"})
    await tool.run_execute(iid, {"answer": "10"})
    await tool.run_execute(iid, {"answer": "12"})
    assert await tool.calc_reward(iid) == 1.0  # against create's ground truth: "10" was right
    assert await tool.run_calc_reward(iid) == 1.0  # against the row's "12": right too
    other = await tool.create(create_kwargs={"ground_truth": "10"}, calc_reward_kwargs={"ground_truth": 99})
    await tool.run_execute(other, {"answer": "10"})
    assert await tool.run_calc_reward(other) == 0.0
    with pytest.raises(ToolKwargsError, match="execute"):  # the checker takes no execute kwargs
        await tool.create(create_kwargs={"ground_truth": 1}, execute_kwargs={"strict": True})
