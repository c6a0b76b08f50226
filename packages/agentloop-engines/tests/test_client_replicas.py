"""LLMServerClient and its policy on stale, busy, slow and hung replicas (issue 31, class 3):
weight pushes tracked per weight name, 503s as backpressure, timeouts that convict a replica
only when another one served the same request, and probing at once when none is in rotation.

Replicas are small in-process engines (no HTTP; tests/fault/test_replicas_round3.py has the
same over real servers).
"""

from __future__ import annotations

import asyncio

import pytest

from agentloop_core.protocol import ServerCapabilities, TokenOutput
from agentloop_engines.fleet.client import LLMServerClient, NoHealthyReplicaError, RequestTimeoutError
from agentloop_engines.fleet.http_client import ReplicaBusyError, _retry_after_s
from agentloop_engines.fleet.routing import StickyLeastInFlightPolicy
from agentloop_engines.fleet.weight_ledger import WeightLedger


class Engine:
    """Tokens are the engine's weight ``w``; ``busy``/``dead``/``hang``/``delay_s`` inject faults."""

    capabilities = ServerCapabilities(weight_update=True)

    def __init__(self) -> None:
        self.weights: dict[str, int] = {"w": 0, "b": 0}
        self.busy = 0  # the next `busy` calls get a 503
        self.dead = False
        self.hang = False
        self.push_hang = False
        self.delay_s = 0.0
        self.refuse = False
        self.calls = 0
        self.gate: asyncio.Event | None = None

    def _check(self) -> None:
        if self.dead:
            raise ConnectionError("down")
        if self.busy:
            self.busy -= 1
            raise ReplicaBusyError("503 at max_in_flight", retry_after_s=0.01)

    async def generate(self, request_id, prompt_ids, sampling_params):
        self.calls += 1
        self._check()
        if self.hang:
            await asyncio.Event().wait()
        if self.gate is not None:
            await self.gate.wait()
            self._check()
        await asyncio.sleep(self.delay_s * sampling_params.max_tokens)
        return TokenOutput(token_ids=[self.weights["w"]], log_probs=None, stop_reason="stop")

    async def abort(self, request_id):
        return None

    async def update_weights(self, named_tensors):
        self._check()
        if self.push_hang:
            await asyncio.Event().wait()
        named = dict(named_tensors)
        if self.refuse or set(named) - set(self.weights):
            raise ValueError(f"no weight named {sorted(set(named) - set(self.weights))}")
        self.weights.update(named)


def fleet(n: int, **kw) -> tuple[LLMServerClient, list[Engine]]:
    engines = [Engine() for _ in range(n)]
    return LLMServerClient(engines, **kw), engines


# ---- the ledger and the policy ---------------------------------------------------------------


def test_ledger_tracks_missed_names_until_every_one_is_pushed_again():
    ledger = WeightLedger(3)
    assert ledger.record(["a", "b"], got=[0, 1], missed=[2]) == ([2], [])
    assert ledger.missing(2) == ["a", "b"]
    # A later bucket with only "a" leaves it stale for "b"; one with "b" brings it back.
    assert ledger.record(["a"], got=[0, 1, 2], missed=[]) == ([], [])
    assert ledger.is_stale(2)
    assert ledger.record(["b"], got=[0, 1, 2], missed=[]) == ([], [2])
    # A push no replica got and none missed (all refused its content) changes nothing.
    assert ledger.record(["a"], got=[], missed=[]) == ([], [])
    assert ledger.pushes == 3
    ledger.record(["a"], got=[0], missed=[1])
    ledger.forget(1)
    assert not ledger.is_stale(1)
    with pytest.raises(ValueError, match="at least one replica"):
        WeightLedger(0)


def test_a_stale_replica_is_never_probed_and_is_due_once_current():
    now = [0.0]
    policy = StickyLeastInFlightPolicy(2, probe_backoff_s=1.0, clock=lambda: now[0])
    policy.mark_unhealthy(1)
    policy.set_stale(1, True)
    now[0] = 100.0
    assert policy.next_probe_in(1) is None
    assert [policy.choose(f"r{i}") for i in range(5)] == [0] * 5
    policy.set_stale(1, False)
    assert policy.next_probe_in(1) == 0.0
    assert policy.choose("next") == 1  # the probe
    # A replica held out with probe=False stays held when it becomes current.
    policy.mark_unhealthy(0, probe=False)
    policy.set_stale(0, True)
    policy.set_stale(0, False)
    assert policy.next_probe_in(0) is None


def test_with_nothing_in_rotation_the_soonest_replica_is_probed_at_once():
    now = [0.0]
    policy = StickyLeastInFlightPolicy(3, probe_backoff_s=5.0, clock=lambda: now[0])
    for i in range(3):
        policy.mark_unhealthy(i)
    policy.set_stale(2, True)
    first = policy.choose("a")
    assert first in (0, 1)
    assert policy.stats.early_probes == 1
    # One probe per replica at a time; a stale one is never probed.
    assert policy.choose("b") == 1 - first
    with pytest.raises(NoHealthyReplicaError, match="probe running.*stale: missed a weight push"):
        policy.choose("c")


def test_suspects_and_busy_replicas_are_chosen_last():
    now = [0.0]
    policy = StickyLeastInFlightPolicy(2, clock=lambda: now[0])
    token = policy.suspect(0)
    assert [policy.choose(f"s{i}") for i in range(3)] == [1, 1, 1]
    assert policy.choose("only", exclude=[1]) == 0  # still in rotation when nothing else is left
    policy.record_success(0)
    assert not policy.is_suspected(0, token)
    policy.note_busy(1, 2.0)
    assert policy.choose("b") == 0
    now[0] = 3.0
    assert policy.healthy_replicas == [0, 1]


@pytest.mark.parametrize(("header", "seconds"), [
    ("1", 1.0), ("0", 0.0), ("2.5", 2.5), ("1e9", 30.0), ("-1", None), ("nan", None), ("inf", None),
    ("Wed, 21 Oct 2015 07:28:00 GMT", None), ("", None), (None, None),
])
def test_retry_after_parsing(header, seconds):
    assert _retry_after_s(header) == seconds


# ---- the client --------------------------------------------------------------------------------


async def test_a_busy_replica_is_not_taken_out_and_the_request_goes_elsewhere():
    client, engines = fleet(2)
    engines[0].busy = 100
    outs = [await client.generate(f"r{i}", [1], {}) for i in range(6)]
    assert {o.extra["replica"] for o in outs} == {1}
    assert client.healthy_replicas == [0, 1]
    assert client.stats["busy"] >= 1
    assert client.stats["replica_failures"] == 0


async def test_every_replica_busy_waits_then_serves_or_gives_up_naming_busy_wait_s():
    client, engines = fleet(2, busy_wait_s=5.0)
    engines[0].busy = engines[1].busy = 3
    out = await client.generate("waits", [1], {})
    assert out.token_ids == [0]
    assert client.healthy_replicas == [0, 1]
    client, engines = fleet(2, busy_wait_s=0.0)
    engines[0].busy = engines[1].busy = 100
    with pytest.raises(NoHealthyReplicaError, match="busy_wait_s=0.0"):
        await client.generate("gives-up", [1], {})
    assert client.healthy_replicas == [0, 1]


async def test_a_replica_out_of_rotation_gets_the_push_and_one_that_misses_it_is_held_out():
    client, engines = fleet(3, probe_backoff_s=0.01)
    engines[1].dead = True
    await client.generate("a", [1], {})
    await client.generate("b", [1], {})
    assert client.healthy_replicas == [0, 2]
    engines[1].dead = False  # back before the push: the push reaches it
    engines[2].dead = True   # down during the push: stale
    with pytest.raises(RuntimeError, match=r"update_weights failed on replicas \[2\]"):
        await client.update_weights([("w", 5), ("b", 1)])
    assert engines[1].weights == {"w": 5, "b": 1}
    assert client.stats["stale"] == [False, False, True]
    engines[2].dead = False
    await asyncio.sleep(0.05)
    outs = [await client.generate(f"c{i}", [1], {}) for i in range(12)]
    assert all(o.token_ids == [5] for o in outs), [o.extra["replica"] for o in outs if o.token_ids != [5]]
    assert engines[2].calls == 1  # the request that took it out; never probed since
    # A bucket with only "w" does not bring it back: it still holds the old "b".
    await client.update_weights([("w", 6)])
    assert client.stats["stale"] == [False, False, True]
    await client.update_weights([("b", 2)])
    assert client.stats["stale"] == [False, False, False]
    outs = [await client.generate(f"d{i}", [1], {}) for i in range(12)]
    assert 2 in {o.extra["replica"] for o in outs}
    assert all(o.token_ids == [6] for o in outs)


async def test_a_push_every_replica_refuses_leaves_none_stale():
    client, _ = fleet(2)
    with pytest.raises(RuntimeError, match="no weight named"):
        await client.update_weights([("nope", 1)])
    assert client.stats["stale"] == [False, False]
    assert client.healthy_replicas == [0, 1]


async def test_a_hung_out_of_rotation_replica_does_not_stall_the_push():
    client, engines = fleet(2, offline_push_timeout_s=0.05)
    engines[1].dead = True
    await client.generate("a", [1], {})
    await client.generate("b", [1], {})
    engines[1].dead, engines[1].push_hang = False, True
    await asyncio.wait_for(client.update_weights([("w", 3)]), 5)  # no error: it was out already
    assert client.stats["stale"] == [False, True]


async def test_a_push_to_a_busy_replica_waits_for_its_slot():
    client, engines = fleet(2)
    engines[1].busy = 2
    await client.update_weights([("w", 4)])
    assert engines[1].weights["w"] == 4
    assert client.stats["stale"] == [False, False]


async def test_a_slow_request_fails_alone_and_a_hung_replica_is_convicted():
    client, engines = fleet(3, request_timeout_s=0.05)
    for e in engines:
        e.delay_s = 0.001
    with pytest.raises(RequestTimeoutError, match=r"'slow'.*request_timeout_s=0.05.*on every replica"):
        await client.generate("slow", [1], {"max_tokens": 1000})
    assert client.healthy_replicas == [0, 1, 2]
    assert client.stats["request_timeouts"] == 1
    assert (await client.generate("fast", [1], {"max_tokens": 2})).token_ids == [0]
    engines[1].hang = True
    for i in range(6):
        await client.generate(f"h{i}", [1], {"max_tokens": 2})
    assert client.healthy_replicas == [0, 2]
    await client.close()


async def test_with_max_retries_0_a_timeout_cannot_convict_a_replica():
    client, engines = fleet(2, request_timeout_s=0.05, max_retries=0)
    engines[0].hang = True
    with pytest.raises(RequestTimeoutError):
        await client.generate("x", [1], {})
    assert client.healthy_replicas == [0, 1]
    await client.close()


async def test_requests_wait_for_a_running_probe_instead_of_being_refused():
    client, engines = fleet(2, probe_backoff_s=60.0)
    for e in engines:
        e.dead = True
    with pytest.raises(NoHealthyReplicaError):
        await client.generate("lost", [1], {})
    for e in engines:
        e.dead = False
        e.gate = asyncio.Event()
    tasks = [asyncio.create_task(client.generate(f"r{i}", [1], {})) for i in range(8)]
    for _ in range(5):
        await asyncio.sleep(0)
    assert client.stats["probes"] == 2  # one per replica; the other six requests wait for them
    for e in engines:
        e.gate.set()
    outs = await asyncio.gather(*tasks)
    assert len(outs) == 8
    assert client.healthy_replicas == [0, 1]
