"""Blocking sync tools and cancelled MCP calls: a sync function tool stuck past its timeout keeps
its thread, but only in the tool's own bounded pool, so ``asyncio.to_thread`` work elsewhere (the
engine's tokenization, file I/O) keeps running and a saturated pool fails new calls at once; an
MCP call cancelled while it waits for the rate limiter gives its token back.

No wall-clock bounds: the ``wait_for`` deadlines only turn a regression into a failure instead
of a hang."""

from __future__ import annotations

import asyncio
import threading

import pytest

from agentloop_tools import function_tool
from agentloop_tools.mcp_config import TokenBucket

STUCK_CALLS = 40  # more than any default executor has threads (min(32, cpus + 4))


async def test_stuck_sync_tools_do_not_starve_the_default_executor():
    release = threading.Event()
    entered: list[str] = []  # list.append is atomic: one entry per call that got a thread

    @function_tool(config={"timeout_s": 0.1})
    def block(x: str) -> str:
        """Blocks until the test releases it, as a sync tool stuck on I/O does.

        Args:
            x: Ignored.
        """
        entered.append(x)
        release.wait()
        return "late"

    iids = [await block.create() for _ in range(STUCK_CALLS)]
    try:
        calls = [asyncio.wait_for(block.run_execute(iid, {"x": "go"}), block.timeout_s) for iid in iids]
        results = await asyncio.gather(*calls, return_exceptions=True)
        # Every call timed out: the first max_sync_threads holding a thread, the rest in the queue.
        assert all(isinstance(r, Exception) for r in results), results
        # The rest of the process still has its default executor.
        assert await asyncio.wait_for(asyncio.to_thread(lambda: 6 * 7), timeout=20) == 42
        stats = block.sync_pool_stats
        assert stats["stuck"] == stats["threads"] == block.max_sync_threads < STUCK_CALLS, stats
        # The calls that were still queued when they timed out never ran.
        assert len(entered) == block.max_sync_threads
        # A new call fails at once with a message naming the tool and the fix, instead of queueing.
        with pytest.raises(RuntimeError, match=r"'block'.*stuck.*max_sync_threads"):
            await asyncio.wait_for(block.run_execute(iids[0], {"x": "go"}), timeout=20)
    finally:
        release.set()
    # Once the blocked functions return, their threads serve new calls again.
    for _ in range(200):
        if block.sync_pool_stats["stuck"] == 0:
            break
        await asyncio.sleep(0.05)
    assert block.sync_pool_stats["stuck"] == 0
    response, _, _ = await asyncio.wait_for(block.run_execute(iids[0], {"x": "go"}), timeout=20)
    assert response.text == "late"


async def test_stuck_thread_count_reaches_the_tool_metrics():
    release = threading.Event()

    @function_tool(config={"timeout_s": 0.1, "max_sync_threads": 2})
    def sometimes_blocks(block: bool) -> str:
        """Blocks when asked to.

        Args:
            block: Whether to block.
        """
        if block:
            release.wait()
        return "ok"

    iid = await sometimes_blocks.create()
    try:
        with pytest.raises((TimeoutError, asyncio.TimeoutError)):
            await asyncio.wait_for(sometimes_blocks.run_execute(iid, {"block": True}), 0.1)
        _, _, metrics = await asyncio.wait_for(sometimes_blocks.run_execute(iid, {"block": False}), 20)
        assert metrics == {"sync_pool_stuck_threads": 1}
    finally:
        release.set()


# ---- the MCP rate limiter ----------------------------------------------------------------------


async def test_a_call_cancelled_while_waiting_for_the_rate_limiter_refunds_its_token():
    bucket = TokenBucket(rate=1.0, burst=1)  # one call per second
    assert await bucket.acquire() == 0.0  # the burst token
    waiting = [asyncio.create_task(bucket.acquire()) for _ in range(5)]
    await asyncio.sleep(0)  # each has reserved its slot and is asleep in the limiter
    for task in waiting:
        task.cancel()
    await asyncio.gather(*waiting, return_exceptions=True)
    assert all(t.cancelled() for t in waiting)
    # Nothing ran, so nothing may be owed: the next caller waits at most for the one token the
    # completed call used (up to 1 s at 1/s), not for five cancelled ones too (about 6 s).
    waited = await asyncio.wait_for(bucket.acquire(), timeout=30)
    assert waited <= 1.0, f"the next call waited {waited:.1f} s: cancelled calls kept their tokens"


async def test_an_mcp_call_cancelled_before_it_runs_gives_its_slot_back(mcp_server):
    RATE = 0.5  # noqa: N806 - one call per 2 s: the calls below surely wait in the limiter
    from agentloop_tools.mcp import aload_mcp_tools

    server = mcp_server()
    tools = await aload_mcp_tools({"mcpServers": {"calc": {"url": server.url, "rate_limit": RATE, "rate_burst": 1,
                                                           "connect_retries": 20, "retry_backoff_s": 0.1}}})
    add = tools["add"]
    iid = await add.create()
    first, _, _ = await asyncio.wait_for(add.run_execute(iid, {"a": 2, "b": 3}), 30)
    assert first.text == "5"
    # Ten calls time out in the limiter (as the loop's per-tool timeout cancels them).
    for _ in range(10):
        with pytest.raises((TimeoutError, asyncio.TimeoutError)):
            await asyncio.wait_for(add.run_execute(iid, {"a": 1, "b": 1}), 0.05)
    response, _, metrics = await asyncio.wait_for(add.run_execute(iid, {"a": 1, "b": 2}), 60)
    # It waits for its own token only (at most 1 / RATE), not for the ten that never ran.
    assert response.text == "3", metrics
    assert metrics["mcp_rate_wait_s"] <= 1 / RATE, metrics
    await add.toolset.aclose()
