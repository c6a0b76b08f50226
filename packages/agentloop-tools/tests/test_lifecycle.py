"""BaseTool lifecycle: per-trajectory state isolation, tools_kwargs forms and their delivery."""

import asyncio
import random

import pytest

from agentloop_tools.base import BaseTool, ToolKwargsError, normalize_tools_kwargs
from agentloop_tools.schema import ToolResponse

SCHEMA = {
    "type": "function",
    "function": {"name": "counter", "description": "Add to a counter.", "parameters": {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}},
}


class CounterTool(BaseTool):
    async def init_state(self, start: int = 0, **_):
        return {"total": start}

    async def execute(self, instance_id, parameters):
        state = self.state(instance_id)
        before = state["total"]
        await asyncio.sleep(random.random() / 1000)  # interleave trajectories
        state["total"] = before + parameters["n"]
        return ToolResponse(text=str(state["total"])), 0.0, {}

    async def calc_reward(self, instance_id):
        return float(self.state(instance_id)["total"])


async def test_fifty_concurrent_trajectories_never_share_state():
    tool = CounterTool({"timeout_s": 3}, SCHEMA)
    assert tool.name == "counter"
    assert tool.timeout_s == 3.0

    async def trajectory(i: int) -> float:
        # Half nested verl-style, half flat: both must work.
        kwargs = {"create_kwargs": {"start": i * 1000}} if i % 2 else {"start": i * 1000}
        iid = await tool.create(**kwargs)
        for _ in range(5):
            await tool.execute(iid, {"n": i})
        reward = await tool.calc_reward(iid)
        await tool.release(iid)
        return reward

    rewards = await asyncio.gather(*(trajectory(i) for i in range(50)))
    assert rewards == [i * 1000 + 5 * i for i in range(50)]
    assert tool.live_instances == 0


async def test_instance_ids_and_errors():
    tool = CounterTool({}, SCHEMA)
    iid = await tool.create("fixed", create_kwargs={"start": 2})
    assert iid == "fixed"
    assert tool.lifecycle_kwargs(iid, "execute") == {}
    with pytest.raises(ValueError, match="already exists"):
        await tool.create("fixed")
    await tool.release(iid)
    await tool.release(iid)  # idempotent
    with pytest.raises(KeyError, match="call create"):
        await tool.execute(iid, {"n": 1})
    a, b = await tool.create(), await tool.create()
    assert a != b


def test_tools_kwargs_forms_and_errors():
    assert normalize_tools_kwargs({"x": 1}) == ({"x": 1}, {})
    assert normalize_tools_kwargs(None) == ({}, {})
    assert normalize_tools_kwargs({"create_kwargs": {"g": "4"}, "release_kwargs": None}) == ({"g": "4"}, {"release_kwargs": {}})
    with pytest.raises(ValueError, match="mixes the nested form"):
        normalize_tools_kwargs({"create_kwargs": {}, "ground_truth": 1}, tool_name="t")
    with pytest.raises(ValueError, match="must be a dict"):
        normalize_tools_kwargs({"create_kwargs": [1]})


def test_constructor_validation():
    with pytest.raises(ValueError, match="needs a tool_schema"):
        CounterTool({}, None)
    with pytest.raises(ValueError, match="timeout_s must be a positive number"):
        CounterTool({"timeout_s": -1}, SCHEMA)
    with pytest.raises(ValueError, match="invalid tool_schema"):
        CounterTool({}, {"type": "function", "function": {}})
    with pytest.raises(TypeError, match="abstract"):
        BaseTool({}, SCHEMA)


class RecordingTool(BaseTool):
    """Takes every lifecycle stage's row kwargs (verl-style **kwargs) and records them."""

    def __init__(self) -> None:
        super().__init__({}, SCHEMA)
        self.seen: list[tuple[str, dict]] = []

    async def execute(self, instance_id, parameters, **kwargs):
        self.seen.append(("execute", kwargs))
        return ToolResponse(text="ok"), 0.0, {}

    async def calc_reward(self, instance_id, **kwargs):
        self.seen.append(("calc_reward", kwargs))
        return 1.0

    async def release(self, instance_id, **kwargs):
        self.seen.append(("release", kwargs))
        await super().release(instance_id)


async def test_run_helpers_deliver_each_stage_its_row_kwargs():
    tool = RecordingTool()
    iid = await tool.create(create_kwargs={"start": 1}, execute_kwargs={"mode": "x"},
                            calc_reward_kwargs={"gt": "4"}, release_kwargs={"keep": False})
    assert tool.state(iid) == {"start": 1}
    await tool.run_execute(iid, {"n": 1})
    assert await tool.run_calc_reward(iid) == 1.0
    await tool.run_release(iid)
    assert tool.seen == [("execute", {"mode": "x"}), ("calc_reward", {"gt": "4"}), ("release", {"keep": False})]
    assert tool.live_instances == 0
    await tool.run_release(iid)  # releasing twice stays a no-op, with no kwargs left to pass
    assert tool.seen[-1] == ("release", {})


async def test_tool_without_kwargs_works_on_rows_without_them():
    tool = CounterTool({}, SCHEMA)
    iid = await tool.create(create_kwargs={"start": 2}, execute_kwargs={}, release_kwargs=None)
    response, _, _ = await tool.run_execute(iid, {"n": 3})
    assert response.text == "5"
    assert await tool.run_calc_reward(iid) == 5.0
    await tool.run_release(iid)
    assert tool.live_instances == 0


@pytest.mark.parametrize("stage", ["execute", "calc_reward", "release"])
async def test_row_kwargs_a_method_cannot_take_are_a_clear_error_at_create(stage):
    # CounterTool.execute/calc_reward take no **kwargs, and BaseTool's default release takes none.
    tool = CounterTool({}, SCHEMA)
    with pytest.raises(ToolKwargsError, match=rf"tool 'counter'.*'{stage}_kwargs'.*\['mode'\].*"
                                              rf"add \*\*kwargs to {stage}"):
        await tool.create(create_kwargs={}, **{f"{stage}_kwargs": {"mode": "x"}})
    assert tool.live_instances == 0  # checked before any state exists
    assert issubclass(ToolKwargsError, TypeError)


async def test_named_parameters_take_row_kwargs_without_var_kwargs():
    class Named(CounterTool):
        async def calc_reward(self, instance_id, scale: float = 1.0):
            return scale * self.state(instance_id)["total"]

    tool = Named({}, SCHEMA)
    iid = await tool.create(create_kwargs={"start": 3}, calc_reward_kwargs={"scale": 2.0})
    assert await tool.run_calc_reward(iid) == 6.0
    with pytest.raises(ToolKwargsError, match="calc_reward"):
        await tool.create(create_kwargs={}, calc_reward_kwargs={"scael": 2.0})
