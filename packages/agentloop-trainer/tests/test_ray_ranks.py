"""FSDP ranks as Ray actors: same losses as one process, rank errors surface, unmet resources fail fast."""

from __future__ import annotations

import sys
import time

import pytest

from agentloop_engines.fleet.hosting import InsufficientResourcesError
from agentloop_trainer.update import RankFailedError, spawn_ray

# Generous: reaching it means a rank hung, never that the machine was slow.
HANG_S = 300


def _raise_on_rank(rank: int, bad_rank: int) -> int:
    import torch.distributed as dist

    if rank == bad_rank:
        raise ValueError(f"boom on rank {rank}")
    # The healthy rank waits for its peer in a collective: without the driver killing it, this
    # would block for gloo's 30-minute timeout.
    dist.barrier()
    return rank


@pytest.fixture(scope="module")
def local_ray(tmp_path_factory):
    pytest.importorskip("ray", reason='needs Ray: pip install "agentloop-trainer[ray]"')
    # Ray workers cannot import pytest's test modules (their folder is not on the workers'
    # sys.path), so ship the rank functions by value, through Ray's own cloudpickle copy
    # (registering with the PyPI one has no effect).
    import test_fsdp
    from ray import cloudpickle

    from agentloop_engines.fleet.hosting import init_local_ray

    cloudpickle.register_pickle_by_value(test_fsdp)
    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    ray = init_local_ray(tmp_path_factory.mktemp("ray"), num_cpus=2)
    yield ray
    ray.shutdown()
    cloudpickle.unregister_pickle_by_value(test_fsdp)
    cloudpickle.unregister_pickle_by_value(sys.modules[__name__])


def _all_placement_groups_removed(ray) -> bool:
    return all(pg["state"] == "REMOVED" for pg in ray.util.placement_group_table().values())


def _placement_group_count(ray) -> int:
    """Placement groups this cluster ever created (removed ones stay in the table)."""
    return len(ray.util.placement_group_table())


def _wait_cpus_free(ray, cpus: float, timeout_s: float = 20.0) -> float:
    # Killed actors release their resources asynchronously.
    deadline = time.monotonic() + timeout_s
    while (free := ray.available_resources().get("CPU", 0.0)) < cpus and time.monotonic() < deadline:
        time.sleep(0.2)
    return free


@pytest.mark.ray
@pytest.mark.slow
def test_two_ray_ranks_match_one_process(local_ray, random_model_path):
    """The rank function of test_fsdp, run by 2 Ray actors, gives the single-process trajectory."""
    from test_fsdp import _fsdp_rank, _steps, assert_same_training
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(random_model_path))
    single = _steps(model)
    sharded, state = spawn_ray(_fsdp_rank, 2, str(random_model_path), num_cpus_per_rank=1.0, timeout_s=60)
    assert_same_training(single, sharded, model, state)
    assert _all_placement_groups_removed(local_ray)
    assert _wait_cpus_free(local_ray, 2.0) == 2.0


@pytest.mark.ray
def test_failing_rank_surfaces_rank_and_traceback_and_stops_peers(local_ray):
    """Rank 1 raises while rank 0 waits in a barrier: the caller gets rank 1's error, not the
    TimeoutError of ``run_timeout_s`` (rank 0 alone would wait for gloo's 30 minutes)."""
    with pytest.raises(RankFailedError) as info:
        spawn_ray(_raise_on_rank, 2, 1, num_cpus_per_rank=1.0, timeout_s=60, run_timeout_s=HANG_S)
    err = info.value
    assert err.rank == 1
    assert err.error_type == "ValueError"
    text = str(err)
    assert "rank 1 of 2" in text
    assert "boom on rank 1" in text
    # the original traceback, formatted inside the rank, names the raising function
    assert "Traceback (most recent call last)" in text
    assert "_raise_on_rank" in text
    # rank 0 was blocked in a collective; it must have been killed, not left holding its CPU
    assert _all_placement_groups_removed(local_ray)
    assert _wait_cpus_free(local_ray, 2.0) == 2.0


@pytest.mark.ray
def test_unmeetable_gpu_request_fails_fast_with_named_resource(local_ray):
    """One GPU per rank on a CPU-only cluster: a clear error naming GPU, not a pending actor.

    The message names the missing resource, what the cluster and its nodes have, and the
    config knobs to change; nothing is reserved.
    """
    groups_before = _placement_group_count(local_ray)
    with pytest.raises(InsufficientResourcesError) as info:
        spawn_ray(_raise_on_rank, 2, 0, device="cuda", num_gpus_per_rank=1.0, timeout_s=60)
    text = str(info.value)
    assert "2 FSDP trainer rank(s) x {CPU: 1, GPU: 1}, strategy PACK" in text
    assert "need GPU: 2, the cluster has GPU: 0" in text
    assert "(nodes: " in text
    assert "(CPU 2, GPU 0)" in text
    assert "lower trainer.fsdp_ranks or ray.rank_num_cpus / ray.rank_num_gpus" in text
    with pytest.raises(InsufficientResourcesError, match=r"need CPU: 3, the cluster has CPU: 2 \(nodes: .*\(CPU 2\)\)"):
        spawn_ray(_raise_on_rank, 2, 0, num_cpus_per_rank=1.5, timeout_s=60)
    # Failing fast means failing before any placement group is made (and then waited on).
    assert _placement_group_count(local_ray) == groups_before
    assert _all_placement_groups_removed(local_ray)


@pytest.mark.ray
def test_resources_held_by_others_time_out_with_free_resources_named(local_ray):
    """The cluster could fit the ranks, but another placement group holds the CPUs: the error
    says so within ``timeout_s`` and tells what is free now."""
    holder = local_ray.util.placement_group([{"CPU": 1.5}])
    assert holder.wait(timeout_seconds=30)
    try:
        groups_before = _placement_group_count(local_ray)
        with pytest.raises(InsufficientResourcesError) as info:
            spawn_ray(_raise_on_rank, 2, 0, num_cpus_per_rank=1.0, timeout_s=2)
        # Checked before reserving: no placement group was made to sit pending behind the holder.
        assert _placement_group_count(local_ray) == groups_before
    finally:
        local_ray.util.remove_placement_group(holder)
    text = str(info.value)
    assert "other actors or placement groups hold its resources; after 2s still" in text
    assert "(free now: " in text
    assert "(CPU 0.5)" in text
    assert "free them (ray.kill / remove_placement_group / stop_replicas)" in text
    assert "trainer.fsdp_ranks" in text
    assert _all_placement_groups_removed(local_ray)


@pytest.mark.ray
def test_a_given_placement_group_not_ready_in_time_names_what_is_free(local_ray):
    """A caller's placement group that cannot be reserved: the error names the free resources
    and the cluster's totals; the group is the caller's and is left alone."""
    holder = local_ray.util.placement_group([{"CPU": 1.5}])
    assert holder.wait(timeout_seconds=30)
    given = local_ray.util.placement_group([{"CPU": 1}] * 2)
    try:
        with pytest.raises(InsufficientResourcesError,
                           match=r"not ready after 1s; free now: \{CPU: 0.5, GPU: 0\}, the cluster has \{CPU: 2"):
            spawn_ray(_raise_on_rank, 2, 0, num_cpus_per_rank=1.0, placement_group=given, timeout_s=1)
        assert local_ray.util.placement_group_table(given)["state"] == "PENDING"
    finally:
        local_ray.util.remove_placement_group(given)
        local_ray.util.remove_placement_group(holder)
    assert _all_placement_groups_removed(local_ray)


def test_bad_arguments_are_named_before_ray_is_touched():
    pytest.importorskip("ray", reason='needs Ray: pip install "agentloop-trainer[ray]"')
    with pytest.raises(ValueError, match="world_size >= 1"):
        spawn_ray(_raise_on_rank, 0)
    with pytest.raises(ValueError, match="unknown placement strategy 'pack'; valid: PACK, SPREAD"):
        spawn_ray(_raise_on_rank, 2, strategy="pack")
    with pytest.raises(ValueError, match="num_gpus_per_rank > 0"):
        spawn_ray(_raise_on_rank, 2, device="cuda")
    with pytest.raises(ValueError, match="device must be"):
        spawn_ray(_raise_on_rank, 2, device="tpu")
    with pytest.raises(ValueError, match=r"needs num_cpus > 0.*num_cpus_per_rank=0"):
        spawn_ray(_raise_on_rank, 2, num_cpus_per_rank=0)


def test_run_fsdp_training_rejects_unknown_launcher():
    from omegaconf import OmegaConf

    from agentloop_trainer.stages import run_fsdp_training

    cfg = OmegaConf.create({"trainer": {"fsdp_ranks": 2, "device": "cpu"}})
    with pytest.raises(ValueError, match="unknown launcher 'slurm'"):
        run_fsdp_training(cfg, "unused", "unused", launcher="slurm")
