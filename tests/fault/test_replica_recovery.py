"""A replica taken out of rotation comes back (issue 18): the client probes it again after a
backoff that grows while it keeps failing, and puts it back into rotation once a probe
succeeds. If this fails, read ``StickyLeastInFlightPolicy.choose`` (probe scheduling) and
``LLMServerClient._routed`` (which reports a probe's success with ``record_success``)."""

from __future__ import annotations

import asyncio
import contextlib

from agentloop_core.testing.scripted import ScriptedServer
from agentloop_engines.fleet.client import LLMServerClient

BACKOFF_S = 0.05


class FlakyReplica(ScriptedServer):
    """Fails ``burst`` consecutive calls with a connection error once ``trip`` is set."""

    def __init__(self, burst: int = 0) -> None:
        super().__init__()
        self.burst = burst
        self.failures = 0
        self.served = 0

    async def generate(self, request_id, prompt_ids, sampling_params):
        if self.burst > 0:
            self.burst -= 1
            self.failures += 1
            raise ConnectionError(f"replica down ({request_id})")
        self.served += 1
        return await super().generate(request_id, prompt_ids, sampling_params)


async def test_a_replica_that_fails_a_burst_returns_to_rotation():
    """Replica 1 fails a burst of calls, then recovers. No request may fail (replica 0 is
    always fine), replica 1 must be probed with growing backoff rather than hammered, and once
    it answers a probe it must serve requests again, with the recovery counted in stats."""
    good, flaky = FlakyReplica(), FlakyReplica(burst=4)
    client = LLMServerClient([good, flaky], probe_backoff_s=BACKOFF_S, max_probe_backoff_s=0.4)
    served_after_recovery = 0
    for i in range(120):
        out = await client.generate(f"r{i}", [1, 2, 3], {"max_tokens": 2})
        if flaky.burst == 0 and out.extra["replica"] == 1:
            served_after_recovery += 1
        await asyncio.sleep(0.01)
        if served_after_recovery >= 3:
            break
    stats = client.stats
    assert flaky.failures == 4, "the burst must be probed through, one failure per probe"
    assert served_after_recovery >= 3, f"replica 1 never came back: {stats}"
    assert client.healthy_replicas == [0, 1]
    assert stats["unhealthy"] == [False, False]
    assert stats["recoveries"] == 1
    assert stats["probes"] >= 4
    assert stats["failed"] == 0
    assert stats["completed"] == i + 1


async def test_unhealthy_flag_and_backoff_are_visible_while_down():
    """While a replica is down the stats name it, and it is not retried before its backoff."""
    good, dead = FlakyReplica(), FlakyReplica(burst=10**6)
    client = LLMServerClient([good, dead], probe_backoff_s=10.0)
    for i in range(20):
        assert (await client.generate(f"d{i}", [1], {"max_tokens": 1})).extra["replica"] == 0
    assert dead.failures == 1, "a replica in backoff must not be sent requests"
    assert client.stats["unhealthy"] == [False, True]
    assert client.stats["recoveries"] == 0


async def test_a_replica_that_missed_a_weight_update_is_not_probed_back():
    """A replica that failed ``update_weights`` holds stale weights: answering a probe must not
    put it back into rotation; only ``mark_healthy`` does."""
    from agentloop_core.protocol import ServerCapabilities

    class Updatable(FlakyReplica):
        capabilities = ServerCapabilities(logprobs=True, weight_update=True)

        async def update_weights(self, named_tensors):
            if self is stale:
                raise ConnectionError("update lost")

    good, stale = Updatable(), Updatable()
    client = LLMServerClient([good, stale], probe_backoff_s=0.01)
    with contextlib.suppress(RuntimeError):  # the stale replica's failure is reported; seen below
        await client.update_weights([("w", 1)])
    await asyncio.sleep(0.05)
    for i in range(5):
        assert (await client.generate(f"w{i}", [1], {"max_tokens": 1})).extra["replica"] == 0
    assert client.stats["unhealthy"] == [False, True]
    assert stale.served == 0
    client.mark_healthy(1)
    assert client.healthy_replicas == [0, 1]
