"""LLMServerClient: least in-flight, sticky sessions, imbalance gate, release, failover.

Replicas are small in-test engines whose requests can be held open, so in-flight counts and
routing decisions are observed under real asyncio concurrency.
"""

from __future__ import annotations

import asyncio

import pytest

from agentloop_core.protocol import CapabilityNotSupportedError, ServerCapabilities, TokenOutput
from agentloop_engines.fleet.client import LLMServerClient, NoHealthyReplicaError, is_replica_failure
from agentloop_engines.fleet.routing import StickyLeastInFlightPolicy


class FakeReplica:
    """An engine whose requests wait on ``gate`` and that can be made to fail."""

    def __init__(self, name: str, *, caps: ServerCapabilities | None = None) -> None:
        self.name = name
        self.capabilities = caps or ServerCapabilities(weight_update=True)
        self.gate = asyncio.Event()
        self.gate.set()
        self.calls: list[str] = []
        self.aborted: set[str] = set()
        self.abort_calls: list[str] = []
        self.weights: list | None = None
        self.dead = False
        self.hang = False
        self.error: BaseException | None = None

    async def generate(self, request_id, prompt_ids, sampling_params):
        self.calls.append(request_id)
        if self.dead:
            raise ConnectionError(f"{self.name} is gone")
        if self.error is not None:
            raise self.error
        if self.hang:
            await asyncio.Event().wait()
        await self.gate.wait()
        # A replica that died while the request waited fails it, like a dropped connection.
        if self.dead:
            raise ConnectionError(f"{self.name} died mid-request")
        reason = "aborted" if request_id in self.aborted else "stop"
        return TokenOutput(token_ids=[len(prompt_ids)], log_probs=[-0.5], stop_reason=reason)

    async def abort(self, request_id):
        self.abort_calls.append(request_id)
        self.aborted.add(request_id)
        self.gate.set()

    async def sleep(self):
        return None

    async def wake_up(self):
        return None

    async def update_weights(self, named_tensors):
        if self.dead:
            raise ConnectionError(f"{self.name} is gone")
        self.weights = list(named_tensors)


async def settle() -> None:
    """Let every runnable task reach its next await."""
    for _ in range(5):
        await asyncio.sleep(0)


def make(n: int, **kw) -> tuple[LLMServerClient, list[FakeReplica]]:
    reps = [FakeReplica(f"r{i}") for i in range(n)]
    return LLMServerClient(reps, **kw), reps


async def test_least_in_flight_spreads_new_sessions_and_fills_the_idlest():
    client, reps = make(3)
    for r in reps:
        r.gate.clear()
    tasks = [asyncio.create_task(client.generate(f"s{i}", [1, 2], {"max_tokens": 4})) for i in range(6)]
    await settle()
    assert client.in_flight == [2, 2, 2]
    reps[1].gate.set()
    await settle()
    assert client.in_flight == [2, 0, 2]
    # The idlest replica gets the next new session even though it has served as many as the others.
    new = asyncio.create_task(client.generate("fresh", [1], {}))
    await settle()
    assert client.in_flight == [2, 0, 2]
    assert new.done()
    assert new.result().extra["replica"] == 1
    for r in reps:
        r.gate.set()
    outs = await asyncio.gather(*tasks)
    assert sorted(o.extra["replica"] for o in outs) == [0, 0, 1, 1, 2, 2]
    assert client.in_flight == [0, 0, 0]


async def test_sticky_sessions_keep_every_turn_of_a_trajectory_on_one_replica():
    client, reps = make(3)

    async def trajectory(tid: str) -> list[int]:
        served = []
        prompt = [1]
        for _turn in range(3):
            out = await client.generate(tid, prompt, {"max_tokens": 2})
            served.append(out.extra["replica"])
            prompt = prompt + out.token_ids + [7]
            await asyncio.sleep(0)
        return served

    results = await asyncio.gather(*(trajectory(f"t{i}") for i in range(6)))
    for served in results:
        assert len(set(served)) == 1, served
    assert sorted(s[0] for s in results) == [0, 0, 1, 1, 2, 2]
    assert client.stats["sticky_hits"] == 12
    assert client.stats["new_sessions"] == 6
    for r in reps:  # each replica saw whole trajectories only
        assert all(r.calls.count(t) == 3 for t in set(r.calls))


async def test_sticky_capacity_evicts_least_recently_used_session():
    client, _ = make(2, sticky_capacity=2)
    await client.generate("a", [1], {})
    await client.generate("b", [1], {})
    await client.generate("a", [1], {})  # refresh a; b is now the oldest
    await client.generate("c", [1], {})  # evicts b
    assert client.policy.session_replica("b") is None
    assert client.policy.session_replica("a") is not None
    assert client.stats["new_sessions"] == 3


async def test_imbalance_gate_moves_a_sticky_request_and_repins_its_session():
    client, reps = make(2, imbalance_threshold=1)
    # Token requests go through the cost model: a 2-request knee makes 2 in flight vs 0 worth a move.
    client.policy.saturation_batch = 2
    for i in range(6):  # first turns alternate: s0, s2, s4 pinned to replica 0
        out = await client.generate(f"s{i}", [1], {})
        assert out.extra["replica"] == i % 2
    reps[0].gate.clear()
    t0 = asyncio.create_task(client.generate("s0", [1, 5], {}))
    await settle()
    t2 = asyncio.create_task(client.generate("s2", [1, 5], {}))
    await settle()
    assert client.in_flight == [2, 0]  # 2 - 0 = 2 > 1: the next sticky request must move
    out4 = await client.generate("s4", [1, 5], {})
    assert out4.extra["replica"] == 1
    assert client.stats["migrations"] == 1
    assert client.policy.session_replica("s4") == 1
    reps[0].gate.set()
    assert [o.extra["replica"] for o in await asyncio.gather(t0, t2)] == [0, 0]
    assert (await client.generate("s4", [1, 5, 6], {})).extra["replica"] == 1
    assert client.in_flight == [0, 0]


def test_policy_gate_threshold_is_strictly_greater_than():
    policy = StickyLeastInFlightPolicy(2, imbalance_threshold=2)
    assert policy.choose("t") == 0
    policy.acquire(0)
    policy.acquire(0)
    assert policy.choose("t") == 0  # 2 extra in flight is not more than 2
    policy.acquire(0)
    assert policy.choose("t") == 1
    assert policy.stats.migrations == 1
    never = StickyLeastInFlightPolicy(2, imbalance_threshold=None)
    assert never.choose("t") == 0
    for _ in range(100):
        never.acquire(0)
    assert never.choose("t") == 0


@pytest.mark.parametrize(("bad", "match"), [
    (dict(num_replicas=0), "need at least one replica, got num_replicas=0"),
    (dict(num_replicas=2, sticky_capacity=0), "sticky_capacity must be >= 1, got 0"),
    (dict(num_replicas=2, imbalance_threshold=-1), "imbalance_threshold must be >= 0 or None"),
])
def test_policy_rejects_bad_parameters(bad, match):
    with pytest.raises(ValueError, match=match):
        StickyLeastInFlightPolicy(**bad)


async def test_engine_error_is_raised_not_retried_and_releases_the_slot():
    client, reps = make(2)
    reps[0].error = RuntimeError("CUDA exploded")
    with pytest.raises(RuntimeError, match="CUDA exploded"):
        await client.generate("x", [1], {})
    assert client.in_flight == [0, 0]
    assert reps[1].calls == []
    assert client.healthy_replicas == [0, 1]
    assert client.stats["failed"] == 1


async def test_validation_error_from_a_replica_is_not_retried():
    client, reps = make(3)
    reps[0].error = ValueError("prompt_ids[0] = 999 is outside the vocabulary")
    with pytest.raises(ValueError, match="outside the vocabulary"):
        await client.generate("x", [999], {})
    assert [len(r.calls) for r in reps] == [1, 0, 0]
    assert client.healthy_replicas == [0, 1, 2]
    assert client.in_flight == [0, 0, 0]


async def test_bad_sampling_params_fail_before_any_replica_is_called():
    client, reps = make(2)
    with pytest.raises(ValueError, match="did you mean 'max_tokens'"):
        await client.generate("x", [1], {"max_token": 3})
    assert all(r.calls == [] for r in reps)
    assert client.stats["routed"] == 0


async def test_abort_goes_to_the_session_replica_and_releases_the_slot():
    client, reps = make(2)
    await client.generate("warm", [1], {})  # pins "warm" to 0, so "job" goes to 1
    reps[1].gate.clear()
    task = asyncio.create_task(client.generate("job", [1, 2, 3], {}))
    await settle()
    assert client.in_flight == [0, 1]
    await client.abort("job")
    out = await task
    assert out.stop_reason == "aborted"
    assert reps[1].abort_calls == ["job"]
    assert reps[0].abort_calls == []
    assert client.in_flight == [0, 0]


async def test_abort_of_unknown_request_reaches_every_replica():
    client, reps = make(3)
    await client.abort("never-seen")
    assert [r.abort_calls for r in reps] == [["never-seen"]] * 3


async def test_caller_cancellation_releases_the_slot():
    client, reps = make(2)
    reps[0].gate.clear()
    task = asyncio.create_task(client.generate("c", [1], {}))
    await settle()
    assert client.in_flight == [1, 0]
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert client.in_flight == [0, 0]


async def test_timeout_fails_over_marks_hung_replica_and_aborts_it():
    client, reps = make(2, request_timeout_s=0.05)
    reps[0].hang = True
    out = await client.generate("slow", [1, 2], {})
    assert out.extra["replica"] == 1
    assert client.healthy_replicas == [1]
    assert client.in_flight == [0, 0]
    await client.close()
    assert reps[0].abort_calls == ["slow"]
    stats = client.stats
    assert stats["timeouts"] == 1
    assert stats["retries"] == 1
    assert stats["replica_failures"] == 1
    # The session followed the request to the healthy replica.
    assert client.policy.session_replica("slow") == 1


async def test_failover_when_a_replica_dies_mid_run_loses_no_request():
    client, reps = make(3)
    for r in reps:
        r.gate.clear()
    ids = [f"q{i}" for i in range(30)]
    tasks = {rid: asyncio.create_task(client.generate(rid, [1, 2, 3], {})) for rid in ids}
    await settle()
    assert client.in_flight == [10, 10, 10]
    reps[1].dead = True  # its 10 in-flight requests fail when they wake; new ones fail at once
    for r in reps:
        r.gate.set()
    outs = await asyncio.gather(*tasks.values())
    assert len(outs) == 30
    assert all(o.stop_reason == "stop" for o in outs)
    assert {o.extra["replica"] for o in outs} == {0, 2}
    assert client.healthy_replicas == [0, 2]
    assert client.in_flight == [0, 0, 0]
    assert client.stats["retries"] == 10
    # Later turns of the moved sessions stay on their new replica.
    moved = [rid for rid in ids if rid in reps[1].calls]
    assert len(moved) == 10
    for rid in moved:
        again = await client.generate(rid, [1, 2, 3, 4], {})
        assert again.extra["replica"] == client.policy.session_replica(rid) != 1


async def test_no_surviving_replica_raises_a_clear_error():
    client, reps = make(2)
    for r in reps:
        r.dead = True
    with pytest.raises(NoHealthyReplicaError, match=r"failed on 2 replica\(s\).*r0 is gone.*r1 is gone"):
        await client.generate("x", [1], {})
    assert client.healthy_replicas == []
    assert client.in_flight == [0, 0]
    with pytest.raises(NoHealthyReplicaError, match="mark_healthy"):
        await client.generate("y", [1], {})
    client.mark_healthy(0)
    reps[0].dead = False
    assert (await client.generate("y", [1], {})).extra["replica"] == 0


async def test_max_retries_limits_failover():
    client, reps = make(3, max_retries=0)
    reps[0].dead = True
    with pytest.raises(NoHealthyReplicaError, match="max_retries=0"):
        await client.generate("x", [1], {})
    assert reps[1].calls == []
    assert reps[2].calls == []


async def test_capabilities_are_the_intersection_and_fan_out_reaches_all():
    reps = [FakeReplica("a", caps=ServerCapabilities(weight_update=True, sleep=True)),
            FakeReplica("b", caps=ServerCapabilities(weight_update=True, sleep=False))]
    client = LLMServerClient(reps)
    assert client.capabilities.weight_update
    assert not client.capabilities.sleep
    with pytest.raises(CapabilityNotSupportedError, match=r"replicas \[1\].*sleep"):
        await client.sleep()
    await client.update_weights(("w", i) for i in range(3))  # a generator is materialised once
    assert reps[0].weights == reps[1].weights == [("w", 0), ("w", 1), ("w", 2)]


async def test_update_weights_takes_a_dead_replica_out_of_rotation():
    client, reps = make(2)
    reps[1].dead = True
    with pytest.raises(RuntimeError, match=r"update_weights failed on replicas \[1\]"):
        await client.update_weights([("w", 1)])
    assert client.healthy_replicas == [0]
    assert reps[0].weights == [("w", 1)]


def test_construction_errors_are_clear():
    with pytest.raises(ValueError, match="at least one replica"):
        LLMServerClient([])
    with pytest.raises(TypeError, match="has no generate"):
        LLMServerClient([object()])

    class NoCaps:
        async def generate(self, *a):
            return None

    with pytest.raises(TypeError, match="ServerCapabilities"):
        LLMServerClient([NoCaps()])


def test_failure_classification():
    assert is_replica_failure(ConnectionResetError())
    assert is_replica_failure(TimeoutError())
    assert not is_replica_failure(ValueError("bad"))
    assert not is_replica_failure(RuntimeError("engine bug"))


async def test_client_serves_a_real_scripted_engine_behind_the_protocol():
    from agentloop_core.protocol import AsyncServer
    from agentloop_core.testing import ScriptedServer

    client = LLMServerClient([ScriptedServer(), ScriptedServer()])
    assert isinstance(client, AsyncServer)
    a = await client.generate("t", [5, 6, 7], {"max_tokens": 5, "seed": 1})
    b = await client.generate("u", [5, 6, 7], {"max_tokens": 5, "seed": 1})
    assert a.token_ids == b.token_ids
    assert len(a.token_ids) == 5
    assert {a.extra["replica"], b.extra["replica"]} == {0, 1}
