"""Checks of the routing simulation's bookkeeping (not of timings): each policy's hit rate and
request counts must follow from how it routes."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_routing import SimConfig, make_workload, simulate  # noqa: E402
from routing_policies import POLICIES, ClairvoyantLane, CumulativeLeastRequests, HashSticky, RoundRobin  # noqa: E402

CFG = SimConfig(trajectories=48, capacity=600.0, seed=3)


@pytest.fixture(scope="module")
def workload():
    return make_workload(CFG)


def test_every_request_is_served_once_per_turn(workload):
    for name, cls in POLICIES.items():
        out = simulate(CFG, workload, cls(CFG.replicas))
        assert sum(out["requests_per_replica"]) == sum(map(len, workload)), name
        assert out["makespan_s"] >= out["lower_bound_s"] * 0.999, name


def test_hash_sticky_always_hits_and_round_robin_rarely(workload):
    sticky = simulate(CFG, workload, HashSticky(CFG.replicas))
    rr = simulate(CFG, workload, RoundRobin(CFG.replicas))
    assert sticky["cache_hit_rate"] == 1.0
    assert rr["cache_hit_rate"] < 0.5
    assert sticky["prefill_tokens"] < rr["prefill_tokens"]


def test_cumulative_least_requests_never_decrements():
    policy = CumulativeLeastRequests(2)
    first = policy.choose("a")
    policy.acquire(first)
    policy.release(first)
    # The finished request still counts: the next one goes to the other replica.
    assert policy.choose("b") != first


def test_clairvoyant_lane_keeps_the_lane_replica_for_its_trajectories(workload):
    lane = {"traj-0", "traj-1"}
    out = simulate(CFG, workload, ClairvoyantLane(CFG.replicas, lane))
    assert out["requests_per_replica"][-1] == len(workload[0]) + len(workload[1])
    assert out["cache_hit_rate"] == 1.0


def test_the_simulation_passes_each_prompt_length_to_the_policy(workload):
    seen = []

    class Recording(HashSticky):
        def choose(self, request_id, prompt_tokens=None):
            seen.append(prompt_tokens)
            return super().choose(request_id)

    simulate(CFG, workload, Recording(CFG.replicas))
    assert len(seen) == sum(map(len, workload))
    assert min(seen) == CFG.prompt_tokens
    assert max(seen) > CFG.prompt_tokens
