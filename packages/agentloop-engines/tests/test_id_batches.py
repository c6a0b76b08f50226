"""``IdBatches``: ids given one at a time go out in batches of at most ``batch``, from one task;
a failed send is logged and the ids after it still go."""

from __future__ import annotations

import asyncio
import logging

import pytest

from agentloop_engines.fleet.id_batches import IdBatches


async def test_ids_given_together_go_together_within_the_batch_size():
    sent: list[list[str]] = []

    async def send(ids: list[str]) -> None:
        sent.append(ids)

    batches = IdBatches(send, 2, "test")
    for k in range(5):
        batches.add(f"r{k}")
    await batches.drain()
    assert sent == [["r0", "r1"], ["r2", "r3"], ["r4"]]
    batches.add("r5")  # a new task once the last one is done
    await batches.drain()
    assert sent[-1] == ["r5"]


async def test_a_failed_send_is_logged_and_the_next_ids_still_go(caplog):
    sent: list[list[str]] = []

    async def send(ids: list[str]) -> None:
        if ids == ["bad"]:
            raise ConnectionError("server gone")
        sent.append(ids)

    batches = IdBatches(send, 1, "http://x: forget_session")
    with caplog.at_level(logging.WARNING, logger="agentloop_engines.fleet.id_batches"):
        batches.add("bad")
        batches.add("good")
        await batches.drain()
    assert sent == [["good"]]
    assert any("http://x: forget_session failed for 1 request ids (ConnectionError: server gone)" in r.getMessage()
               for r in caplog.records)


def test_outside_an_event_loop_nothing_is_queued():
    async def send(ids: list[str]) -> None:
        raise AssertionError("nothing should be sent")

    batches = IdBatches(send, 4, "test")
    batches.add("r0")
    assert batches.task is None
    with pytest.raises(ValueError, match="batch must be >= 1"):
        IdBatches(send, 0, "test")
    assert asyncio.run(_drained(batches)) is None


async def _drained(batches: IdBatches) -> None:
    await batches.drain()
