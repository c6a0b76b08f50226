"""Engine faults during a real rollout: 64 trajectories through AgentLoopManager and an
LLMServerClient over Ray-hosted replicas, while a replica is killed or hangs."""

from __future__ import annotations

import asyncio
import functools

import pytest

from agentloop_core import AgentLoopManager
from agentloop_core.testing import ScriptedServer, tiny_tokenizer_path
from agentloop_core.testing.loops import TEST_CHAT_AGENT

pytestmark = [pytest.mark.ray]

N = 64
CONFIG = {"agent_loop_modules": ["agentloop_core.testing.loops"], "default_agent_loop": TEST_CHAT_AGENT,
          "sampling_params": {"max_tokens": 6, "temperature": 1.0, "logprobs": True}}


def rows(n: int = N) -> list[dict]:
    # Distinct prompts, so the prompt-seeded engine gives every trajectory its own reply.
    return [{"raw_prompt": [{"role": "user", "content": f"question number {i}"}], "index": i} for i in range(n)]


def replicas(n: int, prefix: str, latency_s: float) -> list:
    from agentloop_engines.fleet.hosting import start_replicas

    return start_replicas(functools.partial(ScriptedServer, latency_s=latency_s), n, name_prefix=prefix,
                          num_cpus=0.1)


async def expected_tokens(tokenizer, batch_rows: list[dict]) -> list[list[int]]:
    """What one healthy engine returns for each row: a failover must not change a single token."""
    ref = ScriptedServer()
    out = []
    for row in batch_rows:
        text = tokenizer.apply_chat_template(row["raw_prompt"], add_generation_prompt=True, tokenize=False)
        ids = tokenizer.encode(text, add_special_tokens=False)
        out.append((await ref.generate("ref", ids, CONFIG["sampling_params"])).token_ids)
    return out


async def test_killing_a_replica_mid_rollout_completes_every_trajectory_once(ray_cluster, tokenizer):
    from agentloop_engines.fleet.hosting import local_client

    ray = ray_cluster
    handles = replicas(3, "fault-kill", latency_s=1.0)
    try:
        client = local_client(handles)
        manager = AgentLoopManager(client, tokenizer, CONFIG, num_workers=2)
        batch_rows = rows()
        task = asyncio.create_task(manager.agenerate_sequences(batch_rows))
        # Wait until the whole batch is in flight (64 requests spread over 3 replicas), then kill one.
        for _ in range(200):
            if sum(client.in_flight) == N:
                break
            await asyncio.sleep(0.02)
        assert sum(client.in_flight) == N, client.in_flight
        lost = client.in_flight[1]
        assert lost > 0
        ray.kill(handles[1])
        batch = await asyncio.wait_for(task, timeout=120)

        assert len(batch) == N, [m.get("error") for m in batch.sample_metrics][:3]
        assert batch.num_failed == 0, [m.get("error") for m in batch.sample_metrics][:3]
        assert client.healthy_replicas == [0, 2]
        # Exactly one answer per trajectory reached a caller: the killed requests were re-sent
        # once each, none was served twice.
        assert client.stats["completed"] == N
        assert client.stats["retries"] == lost
        assert client.stats["replica_failures"] == lost
        assert client.in_flight == [0, 0, 0]
        outputs = await manager.agenerate_outputs(batch_rows[:0])  # no-op call keeps the API honest
        assert outputs == []
        # Every trajectory holds exactly the engine's tokens for its own prompt.
        got = [[int(t) for t, m in zip(r, mk, strict=True) if m] for r, mk in
               zip(batch.responses.tolist(), batch.response_mask.tolist(), strict=True)]
        assert got == await expected_tokens(tokenizer, batch_rows)

        # The dead replica gets no more traffic.
        routed_before = client.stats["per_replica"][1]
        again = await asyncio.wait_for(manager.agenerate_sequences(rows(16)), timeout=60)
        assert again.num_failed == 0
        assert client.stats["per_replica"][1] == routed_before
    finally:
        for h in handles:
            ray.kill(h)


async def test_no_surviving_replica_fails_every_sample_with_the_reason(ray_cluster, tokenizer):
    from agentloop_engines.fleet.hosting import local_client

    ray = ray_cluster
    handles = replicas(2, "fault-allkill", latency_s=1.0)
    try:
        client = local_client(handles)
        manager = AgentLoopManager(client, tokenizer, CONFIG, num_workers=2)
        task = asyncio.create_task(manager.agenerate_sequences(rows(16)))
        for _ in range(200):
            if sum(client.in_flight) == 16:
                break
            await asyncio.sleep(0.02)
        for h in handles:
            ray.kill(h)
        batch = await asyncio.wait_for(task, timeout=60)
        assert len(batch) == 16
        assert batch.num_failed == 16
        errors = [m["error"] for m in batch.sample_metrics]
        assert all(e.startswith("NoHealthyReplicaError") for e in errors), errors[0]
        # The reason says how this request's replicas failed, or that none was left and what to do.
        assert all("ActorDiedError" in e or "restart the replicas" in e for e in errors), errors
        assert any("ActorDiedError" in e for e in errors)
        assert batch.metrics["rollout/num_failed"] == 16
        assert client.healthy_replicas == []
    finally:
        for h in handles:
            ray.kill(h)


async def test_a_hung_replica_is_timed_out_and_its_requests_served_elsewhere(ray_cluster, tokenizer):
    from agentloop_engines.fleet.hosting import local_client

    ray = ray_cluster
    good = replicas(1, "fault-good", latency_s=0.05)
    hung = replicas(1, "fault-hung", latency_s=3600.0)  # alive, answers ready(), never generates
    try:
        client = local_client(good + hung, request_timeout_s=2.0)
        manager = AgentLoopManager(client, tokenizer, CONFIG, num_workers=2)
        batch_rows = rows()
        batch = await asyncio.wait_for(manager.agenerate_sequences(batch_rows), timeout=90)
        assert len(batch) == N
        assert batch.num_failed == 0
        assert client.healthy_replicas == [0]
        assert client.stats["timeouts"] >= 1
        assert client.stats["completed"] == N
        got = [[int(t) for t, m in zip(r, mk, strict=True) if m] for r, mk in
               zip(batch.responses.tolist(), batch.response_mask.tolist(), strict=True)]
        assert got == await expected_tokens(tokenizer, batch_rows)
        # Later batches never wait on the hung replica again.
        routed_before = client.stats["per_replica"][1]
        again = await asyncio.wait_for(manager.agenerate_sequences(rows(8)), timeout=30)
        assert again.num_failed == 0
        assert client.stats["per_replica"][1] == routed_before
    finally:
        for h in good + hung:
            ray.kill(h)


def test_tokenizer_path_is_what_ray_workers_would_load():
    # Guard for the fixture above: the tiny tokenizer must be loadable by path (Ray backends).
    assert tiny_tokenizer_path().exists()
