"""BusyClock and BusyTimeServer: the engine's busy time behind a step's
``rollout/engine_idle_fraction`` is the union of its calls' lifetimes, not their sum, and a
call that fails or is cancelled still ends its share."""

from __future__ import annotations

import asyncio

import pytest

from agentloop_core.server_wrapper import BusyClock, BusyTimeServer
from agentloop_core.testing import ScriptedServer


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def fake_time(monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr("agentloop_core.server_wrapper.time.perf_counter", clock)
    return clock


def test_overlapping_calls_count_once_and_a_running_stretch_counts_so_far(fake_time):
    busy = BusyClock()
    busy.enter()  # A at 0
    fake_time.now = 1.0
    busy.enter()  # B at 1, overlapping A
    fake_time.now = 2.0
    busy.leave()  # A ends
    fake_time.now = 3.0
    busy.leave()  # B ends: busy 0..3
    assert busy.seconds() == 3.0
    assert busy.in_flight == 0
    fake_time.now = 5.0
    busy.enter()  # C at 5, after 2 idle seconds
    fake_time.now = 6.0
    assert busy.seconds() == 4.0
    assert busy.in_flight == 1
    fake_time.now = 7.0
    busy.leave()
    fake_time.now = 9.0
    assert busy.seconds() == 5.0


async def test_busy_time_server_times_generate_and_ends_failed_or_cancelled_calls():
    server = BusyTimeServer(ScriptedServer(latency_s=30.0))
    call = asyncio.ensure_future(server.generate("a", [1, 2, 3], {"max_tokens": 2}))
    for _ in range(5):
        await asyncio.sleep(0)
    assert server.clock.in_flight == 1
    assert server.busy_seconds() > 0
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    assert server.clock.in_flight == 0
    with pytest.raises(ValueError, match="max_tokens must be a positive integer"):
        await server.generate("b", [1], {"max_tokens": -1})
    assert server.clock.in_flight == 0
    # everything else passes through to the engine
    assert server.capabilities == server.server.capabilities
