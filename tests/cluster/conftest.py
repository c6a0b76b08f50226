"""A multi-node Ray cluster simulated on this machine (``ray.cluster_utils.Cluster``): a head
node and two worker nodes, each with one CPU, a small object store and its own custom
resource (``head``, ``node_a``, ``node_b``) so a test can pin work to a node."""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

OBJECT_STORE = 100 * 2**20
# OMP_NUM_THREADS=1 in every actor: 2 cores shared by three simulated nodes.
RUNTIME_ENV = {"env_vars": {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}}


@dataclass
class SimCluster:
    """The running simulated cluster."""

    cluster: Any
    """The ``ray.cluster_utils.Cluster``."""
    address: str
    """GCS address of the head (what ``ray.address`` would be)."""
    nodes: dict[str, Any]
    """``"head"``, ``"node_a"``, ``"node_b"`` -> the cluster_utils node handle."""
    node_ids: dict[str, str]
    """The same names -> Ray node ids (hex)."""
    start_s: float
    """Seconds it took to start the three nodes and connect."""
    runtime_env: dict[str, Any]
    """The runtime_env the driver joined with (pass it again when re-joining)."""


@pytest.fixture(scope="module")
def sim_cluster() -> Iterator[SimCluster]:
    ray = pytest.importorskip("ray", reason='cluster tests need Ray: pip install "agentloop-engines[ray]"')
    from ray.cluster_utils import Cluster

    from agentloop_engines.fleet.hosting import connect_ray

    start = time.perf_counter()
    # A private temp root: Cluster writes the address file that `address="auto"` reads there,
    # and Ray's socket paths must stay under 107 bytes.
    tmp = tempfile.mkdtemp(prefix="rayc", dir="/tmp")
    saved = {k: os.environ.get(k) for k in ("RAY_TMPDIR", "RAY_AUTH_MODE", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER")}
    os.environ.update(RAY_TMPDIR=tmp, RAY_AUTH_MODE="disabled", RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0")
    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 1, "resources": {"head": 1}, "object_store_memory": OBJECT_STORE,
            "include_dashboard": False,
        },
    )
    nodes = {"head": cluster.head_node}
    for name in ("node_a", "node_b"):
        nodes[name] = cluster.add_node(num_cpus=1, resources={name: 1}, object_store_memory=OBJECT_STORE)
    cluster.wait_for_nodes()
    connect_ray(cluster.address, runtime_env=RUNTIME_ENV, log_to_driver=False)
    node_ids = {name: node.node_id for name, node in nodes.items()}
    alive = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
    assert alive == set(node_ids.values()), "the simulated cluster did not come up with 3 nodes"
    sim = SimCluster(cluster, cluster.address, nodes, node_ids, time.perf_counter() - start, RUNTIME_ENV)
    print(f"\n[cluster] 3 nodes up and connected in {sim.start_s:.1f}s at {sim.address}")
    try:
        yield sim
    finally:
        ray.shutdown()
        cluster.shutdown()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        shutil.rmtree(tmp, ignore_errors=True)
