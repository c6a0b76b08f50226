"""BaseTool lifecycle: per-trajectory state isolation and tools_kwargs forms."""

import asyncio
import random

import pytest

from agentloop_tools.base import BaseTool, normalize_tools_kwargs
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
    assert tool.name == "counter" and tool.timeout_s == 3.0

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
    iid = await tool.create("fixed", create_kwargs={"start": 2}, execute_kwargs={"mode": "x"})
    assert iid == "fixed"
    assert tool.lifecycle_kwargs(iid, "execute") == {"mode": "x"}
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
