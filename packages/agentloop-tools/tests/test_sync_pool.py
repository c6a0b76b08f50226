"""The bounded pool sync function tools run in: queued calls that are cancelled never run,
context variables reach the function, the size comes from the tool config, tools still pickle."""

from __future__ import annotations

import asyncio
import contextvars
import pickle
import threading

import pytest

from agentloop_tools import FunctionTool, SyncToolPool, function_tool

REQUEST = contextvars.ContextVar("request", default="none")


async def test_a_call_cancelled_while_queued_never_runs_and_takes_no_thread():
    pool = SyncToolPool(1, "t")
    release, ran = threading.Event(), []
    first = asyncio.ensure_future(pool.run(lambda: (release.wait(), ran.append("first"))))
    queued = asyncio.ensure_future(pool.run(lambda: ran.append("queued")))
    await asyncio.sleep(0.05)
    queued.cancel()
    with pytest.raises(asyncio.CancelledError):
        await queued
    release.set()
    await first
    assert await pool.run(lambda: "after") == "after"
    assert ran == ["first"]
    assert pool.stats["stuck"] == 0
    assert pool.stats["started"] == 1


async def test_context_variables_reach_the_function():
    @function_tool
    def who() -> str:
        """Says which request it runs for."""
        return REQUEST.get()

    REQUEST.set("req-7")
    iid = await who.create()
    response, _, metrics = await who.run_execute(iid, {})
    assert response.text == "req-7"
    assert metrics == {}


def test_pool_size_comes_from_the_tool_config_and_is_checked():
    def f() -> str:
        """Nothing."""
        return ""

    assert FunctionTool(f).max_sync_threads == 8
    assert FunctionTool(f, config={"max_sync_threads": 2}).sync_pool_stats["threads"] == 2
    with pytest.raises(ValueError, match="'f': max_sync_threads must be a positive integer, got 0"):
        FunctionTool(f, config={"max_sync_threads": 0})


async def _double(x: int) -> int:
    """Doubles.

    Args:
        x: A number.
    """
    return 2 * x


def triple(x: int) -> int:
    """Triples.

    Args:
        x: A number.
    """
    return 3 * x


async def test_function_tools_still_pickle_with_their_pool():
    tool = pickle.loads(pickle.dumps(FunctionTool(triple, config={"max_sync_threads": 3})))
    iid = await tool.create()
    response, _, _ = await tool.run_execute(iid, {"x": 2})
    assert response.text == "6"
    assert tool.sync_pool_stats["threads"] == 3
    assert pickle.loads(pickle.dumps(FunctionTool(_double))).sync_pool_stats["threads"] == 0
