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


async def test_an_inline_sync_tool_runs_on_the_event_loop_thread_with_no_pool():
    threads: list[int] = []

    def where(x: int) -> int:
        """Records its thread.

        Args:
            x: A number.
        """
        threads.append(threading.get_ident())
        return x

    pooled, inline = FunctionTool(where), FunctionTool(where, config={"inline": True})
    for tool in (pooled, inline):
        iid = await tool.create()
        response, _, _ = await tool.run_execute(iid, {"x": 4})
        assert response.text == "4"
    assert threads[0] != threading.get_ident()  # the pool's thread
    assert threads[1] == threading.get_ident()  # the loop's own
    assert inline.inline
    assert inline.sync_pool_stats["threads"] == 0
    copy = pickle.loads(pickle.dumps(FunctionTool(triple, config={"inline": True})))
    assert copy.inline
    assert copy.sync_pool_stats["threads"] == 0


def test_inline_is_checked():
    with pytest.raises(ValueError, match="'triple': config inline must be true or false, got 'yes'"):
        FunctionTool(triple, config={"inline": "yes"})
    with pytest.raises(ValueError, match="'_double': config inline is for sync functions"):
        FunctionTool(_double, config={"inline": True})


def test_the_built_in_calculator_runs_inline():
    """Its limits bound a call to microseconds, so a thread would only add the wait for the GIL."""
    from agentloop_tools import calculator

    assert calculator.inline
    assert calculator.sync_pool_stats["threads"] == 0
