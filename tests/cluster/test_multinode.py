"""Scale-out on a simulated 3-node Ray cluster: joining it, resource checks before anything
starts, where workers and replicas land, the same tokens as one machine, and a node lost
mid-rollout.

The tests share one cluster (built in conftest) and run in file order: the node-loss test is
last because it removes a node for good.
"""

from __future__ import annotations

import asyncio
import functools
import socket
import time

import numpy as np
import pytest

import agentloop_core.testing.loops  # noqa: F401  registers test_chat
from agentloop_core.runtime import AgentLoopManager
from agentloop_core.testing import ScriptedServer, load_tiny_tokenizer, tiny_tokenizer_path
from agentloop_core.testing.loops import TEST_CHAT_AGENT
from agentloop_engines import LLMServerClient
from agentloop_engines.fleet.hosting import (
    InsufficientResourcesError,
    connect_ray,
    placement_group_for_ranks,
    replica_nodes,
    start_replicas,
    stop_replicas,
)

ray = pytest.importorskip("ray", reason='cluster tests need Ray: pip install "agentloop-engines[ray]"')

pytestmark = [pytest.mark.ray, pytest.mark.slow]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def gcs_state() -> tuple[int, int]:
    """(actors ever created, placement groups ever created) according to the GCS."""
    return len(ray._private.state.actors()), len(ray.util.placement_group_table())


def test_connect_ray_joins_by_address_and_auto_and_explains_a_bad_address(sim_cluster, monkeypatch):
    assert ray.is_initialized()  # the fixture joined with connect_ray(cluster.address)
    assert {n["NodeID"] for n in ray.nodes() if n["Alive"]} == set(sim_cluster.node_ids.values())
    ray.shutdown()  # disconnect this driver only; the cluster keeps running
    port = free_port()
    init_addresses: list[str] = []
    real_init = ray.init

    def recording_init(*args, **kwargs):
        init_addresses.append(kwargs.get("address"))
        return real_init(*args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(ray, "init", recording_init)
        for bad in (f"127.0.0.1:{port}", f"ray://127.0.0.1:{port}"):
            with pytest.raises(ConnectionError, match=rf"cannot join the Ray cluster at ray.address='{bad}'.*ray start --head"):
                connect_ray(bad, connect_timeout_s=2)
            assert not ray.is_initialized()
    # ray.init alone retries a dead address for minutes: the probe must answer before it.
    assert init_addresses == []
    connect_ray("auto", runtime_env=sim_cluster.runtime_env, log_to_driver=False)  # the address file Cluster wrote
    assert {n["NodeID"] for n in ray.nodes() if n["Alive"]} == set(sim_cluster.node_ids.values())
    assert ray.get_runtime_context().gcs_address.rsplit(":", 1)[1] == sim_cluster.address.rsplit(":", 1)[1]


def test_resource_check_fails_before_anything_starts(sim_cluster):
    before = gcs_state()
    with pytest.raises(InsufficientResourcesError, match=r"2 engine replica\(s\).*need GPU: 2, the cluster has GPU: 0 "
                       r"\(nodes: .*\).*actor_rollout_ref.rollout.num_replicas"):
        start_replicas(ScriptedServer, 2, num_gpus=1, name_prefix="want-gpu", placement_strategy="PACK")
    with pytest.raises(InsufficientResourcesError, match="need node_c: 1, the cluster has node_c: 0"):
        start_replicas(ScriptedServer, 1, resources={"node_c": 1}, name_prefix="want-node-c")
    # 3 CPUs in the cluster, but one per node: STRICT_PACK of 2 full-CPU ranks fits nowhere.
    with pytest.raises(InsufficientResourcesError, match=r"STRICT_PACK puts all bundles on one node.*fsdp_ranks"):
        placement_group_for_ranks(2, num_cpus=1, strategy="STRICT_PACK")
    with pytest.raises(InsufficientResourcesError, match=r"fits on no single node \(the largest node has \{CPU: 1\}\)"):
        placement_group_for_ranks(1, num_cpus=2)
    with pytest.raises(InsufficientResourcesError, match=r"STRICT_SPREAD .* 4 bundles on its own node, but only 3"):
        start_replicas(ScriptedServer, 4, num_cpus=0.1, name_prefix="too-spread", placement_strategy="STRICT_SPREAD")
    assert gcs_state() == before  # no actor, no placement group was created


def test_workers_and_spread_replicas_land_on_different_nodes(sim_cluster):
    ids = sim_cluster.node_ids
    config = {"default_agent_loop": TEST_CHAT_AGENT, "sampling_params": {"max_tokens": 3}}
    with AgentLoopManager(ScriptedServer(), str(tiny_tokenizer_path()), config, num_workers=3, backend="ray",
                          ray_num_cpus=0.1, ray_timeout_s=180, placement="spread") as manager:
        # Round-robin over the alive nodes, sorted by id: one worker on each node.
        assert manager.worker_node_ids() == sorted(ids.values())
        assert manager.generate_sequences([{"raw_prompt": [{"role": "user", "content": "hi"}]}] * 3).num_failed == 0
    for strategy in ("SPREAD", "STRICT_SPREAD"):
        handles = start_replicas(ScriptedServer, 3, num_cpus=0.2, name_prefix=f"spread-{strategy}",
                                 placement_strategy=strategy, ready_timeout_s=180)
        try:
            assert sorted(replica_nodes(handles)) == sorted(ids.values()), strategy
        finally:
            stop_replicas(f"spread-{strategy}")

    # Soft affinity: with node_a's CPU held, the worker meant for node_a starts elsewhere.
    pg = placement_group_for_ranks(1, num_cpus=1, resources={"node_a": 1}, timeout_s=60)
    try:
        with AgentLoopManager(ScriptedServer(), str(tiny_tokenizer_path()), config, num_workers=3, backend="ray",
                              ray_num_cpus=0.1, ray_timeout_s=180) as manager:
            placed = manager.worker_node_ids()
            assert len(placed) == 3
            assert ids["node_a"] not in placed
    finally:
        from agentloop_engines.fleet.hosting import remove_placement_group

        remove_placement_group(pg)


HF_CONFIG = {
    "default_agent_loop": "single_turn_agent",
    "sampling_params": {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "max_tokens": 12, "logprobs": True},
    "sampling_seed": 1234,
    "prompt_length": 64,
    "response_length": 12,
}


def hf_rows(n: int) -> list[dict]:
    return [{"raw_prompt": [{"role": "user", "content": f"question {i % 8}: add {i} and {i + 1}"}]} for i in range(n)]


def test_64_trajectories_over_two_nodes_equal_the_single_node_result(sim_cluster):
    from agentloop_engines import HFServer
    from agentloop_engines.testing.tiny_model import build_tiny_model

    model = build_tiny_model(initializer_range=0.3)  # prompt-dependent outputs, varied lengths
    rows = hf_rows(64)
    start = time.perf_counter()
    local = AgentLoopManager(HFServer(model), model, HF_CONFIG, num_workers=1).generate_sequences(rows, step=3)
    local_s = time.perf_counter() - start

    start = time.perf_counter()
    handles = start_replicas(functools.partial(HFServer, model), 2, num_cpus=0.3, name_prefix="hf",
                             placement_strategy="STRICT_SPREAD", ready_timeout_s=240)
    try:
        nodes = replica_nodes(handles)
        assert len(set(nodes)) == 2, nodes
        # Every worker gets its own copy of the client (a pickled LLMServerClient over the
        # replica handles) and reaches replicas on other nodes through them.
        with AgentLoopManager(LLMServerClient(handles), model, HF_CONFIG, num_workers=2, backend="ray",
                              ray_num_cpus=0.1, ray_timeout_s=240) as manager:
            assert len(set(manager.worker_node_ids())) == 2
            setup_s = time.perf_counter() - start
            start = time.perf_counter()
            remote = manager.generate_sequences(rows, step=3)
            remote_s = time.perf_counter() - start
    finally:
        stop_replicas("hf")
    print(f"\n[cluster] 64 trajectories: single node in-process {local_s:.1f}s; 2 nodes x (replica + worker) "
          f"{remote_s:.1f}s after {setup_s:.1f}s of actor start-up")
    assert remote.num_failed == 0
    assert local.num_failed == 0
    np.testing.assert_array_equal(remote.responses, local.responses)
    np.testing.assert_array_equal(remote.response_mask, local.response_mask)
    np.testing.assert_array_equal(remote.prompts, local.prompts)
    np.testing.assert_allclose(remote.rollout_log_probs, local.rollout_log_probs, atol=1e-4)
    # The samples really spread over both replicas (else the comparison shows nothing).
    assert local.response_mask.sum() > 64 * 3


LOSS_CONFIG = {
    "default_agent_loop": TEST_CHAT_AGENT,
    "sampling_params": {"max_tokens": 4},
    "sampling_seed": 77,
    "prompt_length": 48,
    "response_length": 16,
}


def test_removing_a_node_mid_rollout_loses_no_trajectory(sim_cluster):
    tokenizer = load_tiny_tokenizer()
    rows = [{"raw_prompt": [{"role": "user", "content": f"item {i}"}], "observation": f"tool {i}"} for i in range(64)]
    eos = tokenizer.eos_token_id
    reference = AgentLoopManager(ScriptedServer(eos_token_id=eos), tokenizer, LOSS_CONFIG).generate_sequences(rows, step=1)

    # One replica pinned to each worker node; one rollout worker on each of the 3 nodes.
    latency = 1.5
    engine = functools.partial(ScriptedServer, eos_token_id=eos, latency_s=latency)
    handles = [start_replicas(engine, 1, num_cpus=0.1, name_prefix=f"loss-{n}", resources={n: 0.1})[0]
               for n in ("node_a", "node_b")]
    assert replica_nodes(handles) == [sim_cluster.node_ids["node_a"], sim_cluster.node_ids["node_b"]]
    manager = AgentLoopManager(LLMServerClient(handles), str(tiny_tokenizer_path()), LOSS_CONFIG, num_workers=3,
                               backend="ray", ray_num_cpus=0.1, ray_timeout_s=300)
    try:
        assert sim_cluster.node_ids["node_a"] in manager.worker_node_ids()
        start = time.perf_counter()
        healthy = manager.generate_sequences(rows, step=1)
        healthy_s = time.perf_counter() - start
        assert healthy.num_failed == 0

        async def remove_mid_batch() -> tuple[object, float, float]:
            begin = time.perf_counter()
            task = asyncio.ensure_future(manager.agenerate_sequences(rows, step=1))
            await asyncio.sleep(latency * 0.6)  # every sample is waiting on its first generate
            assert not task.done()
            removed = time.perf_counter()
            sim_cluster.cluster.remove_node(sim_cluster.nodes["node_a"])
            batch = await task
            return batch, removed - begin, time.perf_counter() - removed

        batch, removed_after_s, recovery_s = asyncio.run(remove_mid_batch())
    finally:
        manager.shutdown()
        for h in handles:
            stop_replicas([h])

    metrics = batch.metrics
    failed = [m for m in batch.sample_metrics if m.get("failed")]
    reruns = sum(bool(m.get("rerun_after")) for m in batch.sample_metrics)
    print(
        f"\n[cluster] node loss: healthy batch {healthy_s:.1f}s; node_a removed {removed_after_s:.1f}s into the "
        f"batch; the batch finished {recovery_s:.1f}s later. 64 in, {len(batch)} out: {64 - len(failed)} finished, "
        f"{len(failed)} failed; worker_failures={metrics['rollout/worker_failures']:.0f}, samples re-run on a "
        f"surviving worker={metrics['rollout/num_retried']:.0f} ({reruns} carry rerun_after), workers left="
        f"{metrics['rollout/num_workers']:.0f}"
    )
    for m in failed[:3]:
        print(f"[cluster]   failed sample {m.get('sample_index')}: {m['error'][:200]}")
    assert len(batch) == 64
    assert all(m.get("error") for m in failed)  # a failure always says why
    assert metrics["rollout/worker_failures"] == 1  # the worker on node_a
    assert metrics["rollout/num_retried"] > 0
    assert metrics["rollout/num_workers"] == 2
    # Finished samples carry exactly the tokens the healthy run produced (seeded sampling):
    # the re-run and the replica failover changed where they ran, not what they are.
    ok = ~batch.failed
    np.testing.assert_array_equal(batch.responses[ok], reference.responses[ok])
    np.testing.assert_array_equal(batch.response_mask[ok], reference.response_mask[ok])
