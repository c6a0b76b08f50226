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


async def test_check_answer_rewards_and_best_reward():
    tool = Gsm8kTool({}, None)
    assert tool.name == "check_answer"
    iid = await tool.create(create_kwargs={"ground_truth": "#### 1,234"})
    resp, reward, metrics = await tool.execute(iid, {"answer": "1233"})
    assert reward == 0.0
    assert "Incorrect" in resp.text
    assert metrics == {"attempts": 1}
    resp, reward, _ = await tool.execute(iid, {"answer": "The total is $1,234.00"})
    assert (reward, resp.text) == (1.0, "Correct.")
    await tool.execute(iid, {"answer": "nothing"})  # a later wrong answer keeps the best reward
    assert await tool.calc_reward(iid) == 1.0
    other = await tool.create(ground_truth=7)  # flat tools_kwargs
    assert await tool.calc_reward(other) == 0.0


async def test_missing_ground_truth_is_an_error():
    tool = Gsm8kTool({}, None)
    with pytest.raises(ValueError, match="numeric ground_truth"):
        await tool.create(create_kwargs={})
    with pytest.raises(ValueError, match="unexpected create kwargs"):
        await tool.create(create_kwargs={"ground_truth": 1, "gt": 2})


async def test_calc_reward_kwargs_rescore_against_another_ground_truth():
    tool = Gsm8kTool({}, None)
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
