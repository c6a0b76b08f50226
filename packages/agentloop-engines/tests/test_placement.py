"""Placement: the resource check's logic on synthetic nodes, the deprecated module paths,
then placement groups, named replicas and connect_ray on a real local Ray. Multi-node
behaviour is in tests/cluster."""

from __future__ import annotations

import functools
import subprocess
import sys

import pytest

from agentloop_core.testing import ScriptedServer
from agentloop_engines.fleet.hosting.placement import _placement_problem, bundle_for, check_strategy

CPU4 = {"CPU": 4.0}
GPU_NODE = {"CPU": 8.0, "GPU": 2.0}


def problem(bundles, nodes, strategy="PACK"):
    names = sorted({k for b in bundles for k in b})
    return _placement_problem(bundles, {f"n{i}": n for i, n in enumerate(nodes)}, strategy, names)


def test_missing_resource_is_named_with_totals():
    msg = problem([{"CPU": 1, "GPU": 1}] * 4, [CPU4, CPU4])
    assert msg == "need GPU: 4, the cluster has GPU: 0"
    msg = problem([{"CPU": 1, "GPU": 1}] * 4, [GPU_NODE])
    assert msg == "need GPU: 4, the cluster has GPU: 2"
    assert "need trainer_node: 2, the cluster has trainer_node: 0" in problem([{"trainer_node": 1}] * 2, [CPU4])


def test_a_bundle_bigger_than_any_node_never_fits():
    msg = problem([{"CPU": 6}], [CPU4, CPU4])
    assert "fits on no single node" in msg
    assert "{CPU: 4}" in msg


def test_strategies():
    two_nodes = [CPU4, CPU4]
    assert problem([{"CPU": 2}] * 4, two_nodes, "PACK") is None
    assert problem([{"CPU": 2}] * 4, two_nodes, "SPREAD") is None
    assert "STRICT_PACK puts all bundles on one node" in problem([{"CPU": 2}] * 4, two_nodes, "STRICT_PACK")
    assert problem([{"CPU": 2}] * 2, two_nodes, "STRICT_PACK") is None
    assert "only 2 node(s)" in problem([{"CPU": 1}] * 3, two_nodes, "STRICT_SPREAD")
    assert problem([{"CPU": 1}] * 2, two_nodes, "STRICT_SPREAD") is None
    # Totals suffice (CPU 6 of 8) but 3 bundles of 2.5 CPUs cannot share 4-CPU nodes.
    assert "do not pack" in problem([{"CPU": 2.5}] * 3, two_nodes, "PACK")
    # STRICT_SPREAD is a matching: the GPU bundle must take the GPU node, the CPU one the other.
    assert problem([{"CPU": 1}, {"GPU": 1}], [GPU_NODE, CPU4], "STRICT_SPREAD") is None
    assert "only 1 node(s)" in problem([{"GPU": 1}, {"GPU": 1}], [GPU_NODE, CPU4], "STRICT_SPREAD")


def test_bundle_for():
    assert bundle_for(1, 0) == {"CPU": 1.0}
    assert bundle_for(0.5, 1, {"a100": 1}) == {"a100": 1.0, "CPU": 0.5, "GPU": 1.0}
    with pytest.raises(ValueError, match="needs num_cpus > 0"):
        bundle_for(0, 0)
    with pytest.raises(ValueError, match=">= 0"):
        bundle_for(-1, 0)


def test_check_strategy_lists_the_valid_ones():
    assert check_strategy("SPREAD") == "SPREAD"
    with pytest.raises(ValueError, match="unknown placement strategy 'pack'; valid: PACK, SPREAD, STRICT_PACK"):
        check_strategy("pack")


def test_importing_engines_and_hosting_does_not_import_ray():
    code = ("import sys, agentloop_engines, agentloop_engines.fleet.hosting; "
            "print(sorted(m for m in ('ray',) if m in sys.modules))")
    out = subprocess.run([sys.executable, "-W", "error::DeprecationWarning", "-c", code],
                         capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stderr


# ---- on a real local Ray -----------------------------------------------------------------------

ray = pytest.importorskip("ray", reason='placement tests need Ray: pip install "agentloop-engines[ray]"')

from agentloop_engines.fleet.hosting import (  # noqa: E402
    InsufficientResourcesError,
    ReplicaSet,
    check_resources,
    connect_ray,
    find_replicas,
    placement_group_for_ranks,
    rank_scheduling_strategy,
    remove_placement_group,
    replica_nodes,
    start_replicas,
    stop_replicas,
)


@pytest.fixture(scope="module")
def local_ray(tmp_path_factory):
    import tempfile

    # connect_ray starts a local Ray when no address is given; a short temp dir keeps socket
    # paths under the 107-byte limit.
    r = connect_ray(temp_dir=tempfile.mkdtemp(prefix="rayp", dir="/tmp"), num_cpus=2)
    assert connect_ray() is r  # already initialised: reused
    yield r
    ray.shutdown()


@pytest.mark.ray
def test_check_resources_on_the_live_cluster(local_ray):
    check_resources([{"CPU": 1}] * 2, strategy="STRICT_PACK")
    with pytest.raises(InsufficientResourcesError, match=r"2 replicas: need GPU: 2, the cluster has GPU: 0 .*; add GPUs"):
        check_resources([{"CPU": 1, "GPU": 1}] * 2, what="2 replicas", fix="add GPUs")
    with pytest.raises(ValueError, match="unknown placement strategy 'CLOSE'"):
        check_resources([{"CPU": 1}], strategy="CLOSE")


@pytest.mark.ray
def test_replicas_in_a_placement_group_are_found_by_name_and_stopped(local_ray):
    factory = functools.partial(ScriptedServer, latency_s=0.0)
    handles = start_replicas(factory, 2, num_cpus=0.5, name_prefix="pg-test", placement_strategy="PACK",
                             placement_timeout_s=60)
    try:
        node = ray.get_runtime_context().get_node_id()
        assert replica_nodes(handles) == [node, node]
        assert isinstance(handles, ReplicaSet)
        assert handles.name_prefix == "pg-test"
        found = find_replicas("pg-test", timeout_s=5)
        assert isinstance(found, ReplicaSet)
        assert found.name_prefix == "pg-test"
        assert _pids(found) == _pids(handles)
        pg = ray.util.get_placement_group("pg-test-pg")
        assert handles.placement_group.id == pg.id
        assert found.placement_group.id == pg.id
        assert ray.util.placement_group_table(pg)["state"] == "CREATED"
        # The group holds 1 of the 2 CPUs: a second request for 2 full CPUs is refused at once,
        # naming the held resources, instead of pending forever.
        with pytest.raises(InsufficientResourcesError, match="other actors or placement groups hold"):
            start_replicas(factory, 2, num_cpus=1, name_prefix="pg-blocked", placement_strategy="PACK")
        with pytest.raises(LookupError, match="found 0 replica"):
            find_replicas("pg-blocked", timeout_s=0.5)
    finally:
        assert stop_replicas("pg-test") == 2
    assert ray.util.placement_group_table(pg)["state"] == "REMOVED"
    with pytest.raises(LookupError):
        find_replicas("pg-test", timeout_s=0.5)


def _pids(handles) -> list[int]:
    return [info["pid"] for info in ray.get([h.ready.remote() for h in handles], timeout=60)]


@pytest.mark.ray
def test_stop_replicas_releases_the_group_of_a_replica_set_not_of_a_plain_list(local_ray):
    """A ReplicaSet carries its placement group, so stopping it releases the group; a plain
    list of handles says nothing about a group, so only its actors are killed."""
    factory = functools.partial(ScriptedServer, latency_s=0.0)
    replicas = start_replicas(factory, 2, num_cpus=0.25, name_prefix="set", placement_strategy="SPREAD",
                              placement_timeout_s=60)
    pg = replicas.placement_group
    assert repr(replicas) == "ReplicaSet(2 x 'set'-<i>, placement group set-pg)"
    assert type(replicas[:1]) is list  # a slice is a plain list: the group belongs to the whole set
    assert stop_replicas(list(replicas)) == 2
    assert ray.util.placement_group_table(pg)["state"] == "CREATED"  # a plain list cannot release it
    assert stop_replicas(replicas) == 2  # killing a dead actor again is harmless
    assert ray.util.placement_group_table(pg)["state"] == "REMOVED"
    stop_replicas("set")  # by prefix after all is gone: a removed group is no error


@pytest.mark.ray
def test_replicas_without_placement_are_checked_too(local_ray):
    before = len(ray._private.state.actors())
    with pytest.raises(InsufficientResourcesError, match=r"3 engine replica\(s\).*need GPU: 3, the cluster has GPU: 0"):
        start_replicas(ScriptedServer, 3, num_gpus=1, name_prefix="no-gpu")
    assert len(ray._private.state.actors()) == before  # nothing was started
    handles = start_replicas(ScriptedServer, 1, name_prefix="plain")
    assert handles.placement_group is None
    assert stop_replicas(handles) == 1


@pytest.mark.ray
def test_placement_group_for_ranks(local_ray):
    pg = placement_group_for_ranks(2, num_cpus=0.5, strategy="STRICT_PACK", timeout_s=60)
    try:
        @ray.remote(num_cpus=0.5)
        def rank_node(rank: int) -> tuple[int, str]:
            return rank, ray.get_runtime_context().get_node_id()

        out = ray.get([rank_node.options(scheduling_strategy=rank_scheduling_strategy(pg, r)).remote(r)
                       for r in range(2)], timeout=60)
        assert [r for r, _ in out] == [0, 1]
    finally:
        remove_placement_group(pg)
    remove_placement_group(pg)  # twice is fine
    with pytest.raises(InsufficientResourcesError, match=r"4 FSDP trainer rank\(s\) x \{CPU: 1\}, strategy PACK: "
                       r"need CPU: 4, the cluster has CPU: 2 .*fsdp_ranks"):
        placement_group_for_ranks(4, num_cpus=1)
