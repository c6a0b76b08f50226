"""The thread pool ``http_agent`` runs synchronous agents on (``agentloop_engines.serving.sync_agents``)."""

from __future__ import annotations

import asyncio
import contextvars
import threading

import pytest

from agentloop_engines.serving.http_agent import HTTPAgentConfig
from agentloop_engines.serving.sync_agents import SyncAgentPool, SyncAgentPoolFullError, sync_agent_pool

VAR: contextvars.ContextVar[str] = contextvars.ContextVar("VAR", default="unset")


async def test_samples_past_the_pool_wait_for_a_thread_in_order():
    pool = SyncAgentPool(1)
    order: list[int] = []
    gate = threading.Event()

    def agent(i: int) -> int:
        if i == 0:
            gate.wait(10)
        order.append(i)
        return i * 10

    tasks = [asyncio.create_task(pool.run(agent, i, timeout_s=30)) for i in range(4)]
    await asyncio.sleep(0.1)
    assert pool.stats["waiting"] == 3
    assert pool.stats["started"] == 1
    gate.set()
    assert await asyncio.gather(*tasks) == [0, 10, 20, 30]
    assert order == [0, 1, 2, 3]


async def test_the_timeout_counts_from_when_the_agent_starts():
    pool = SyncAgentPool(1)
    gate = threading.Event()
    first = asyncio.create_task(pool.run(gate.wait, 10, timeout_s=30))
    second = asyncio.create_task(pool.run(lambda: "ran", timeout_s=0.5))
    await asyncio.sleep(1.0)  # twice the second one's timeout, spent waiting for the thread
    assert not second.done()
    gate.set()
    assert await second == "ran"
    assert await first is True


async def test_context_variables_reach_the_agent():
    VAR.set("from the sample")
    assert await SyncAgentPool(2).run(VAR.get, timeout_s=5) == "from the sample"


async def test_an_agent_error_reaches_the_sample_and_frees_the_thread():
    pool = SyncAgentPool(1)

    def fails() -> None:
        raise RuntimeError("agent bug")

    with pytest.raises(RuntimeError, match="agent bug"):
        await pool.run(fails, timeout_s=5)
    assert await pool.run(lambda: 1, timeout_s=5) == 1
    assert pool.stats["stuck"] == 0


async def test_waiting_samples_fail_once_every_thread_is_stuck():
    pool = SyncAgentPool(1)
    release = threading.Event()
    stuck = asyncio.create_task(pool.run(release.wait, 30, timeout_s=0.3))
    waiting = asyncio.create_task(pool.run(lambda: "never", timeout_s=5))
    with pytest.raises(TimeoutError, match="timeout_s=0.3"):
        await stuck
    with pytest.raises(SyncAgentPoolFullError, match="max_sync_agent_threads"):
        await waiting
    assert pool.stats["stuck"] == 1
    release.set()
    for _ in range(100):  # the thread comes back once the agent returns
        if pool.stats["stuck"] == 0:
            break
        await asyncio.sleep(0.02)
    assert await pool.run(lambda: "again", timeout_s=5) == "again"


async def test_a_sample_cancelled_while_waiting_never_runs():
    pool = SyncAgentPool(1)
    gate = threading.Event()
    ran: list[str] = []
    first = asyncio.create_task(pool.run(gate.wait, 10, timeout_s=30))
    queued = asyncio.create_task(pool.run(lambda: ran.append("queued"), timeout_s=30))
    await asyncio.sleep(0.05)
    queued.cancel()
    with pytest.raises(asyncio.CancelledError):
        await queued
    gate.set()
    await first
    assert await pool.run(lambda: "next", timeout_s=5) == "next"
    assert ran == []
    assert pool.stats["stuck"] == 0


@pytest.mark.parametrize("bad", [0, -1, 2.5, True, "8", None])
def test_the_pool_size_must_be_a_positive_integer(bad):
    with pytest.raises(ValueError, match="max_sync_agent_threads"):
        sync_agent_pool(bad)
    with pytest.raises(ValueError, match="max_sync_agent_threads"):
        HTTPAgentConfig.from_mapping({"agent": print, "max_sync_agent_threads": bad})


def test_one_pool_per_size():
    assert sync_agent_pool(3) is sync_agent_pool(3)
    assert sync_agent_pool(3) is not sync_agent_pool(4)
    assert HTTPAgentConfig.from_mapping({"agent": print, "max_sync_agent_threads": 3}).max_sync_agent_threads == 3
