"""`agentloop rollout ray.address=...` from a separate driver process joins the simulated
cluster: engine replicas land on two different nodes, every trajectory comes back, and the
same command on one machine (in-process) writes the same tokens."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ray = pytest.importorskip("ray", reason='cluster tests need Ray: pip install "agentloop-engines[ray]"')

pytestmark = [pytest.mark.ray, pytest.mark.slow]

SMALL = ["actor_rollout_ref.rollout.n=4", "actor_rollout_ref.rollout.multi_turn.max_tokens_per_turn=12",
         "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=2", "data.max_response_length=40",
         "data.train_size=64", "data.val_size=8"]


def _rollout(checkpoint: Path, out: Path, *overrides: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "RAY_AUTH_MODE": "disabled"}
    cmd = [sys.executable, "-m", "agentloop_trainer.cli.main", "rollout", str(checkpoint), *SMALL, *overrides,
           "--out", str(out), "--num-prompts", "6"]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_agentloop_rollout_joins_the_cluster_by_address(sim_cluster, tmp_path):
    from agentloop_core.testing import load_tiny_tokenizer
    from agentloop_trainer.policy import TinyModelConfig, build_tiny_policy

    tokenizer = load_tiny_tokenizer()
    checkpoint = tmp_path / "policy"
    build_tiny_policy(tokenizer, seed=0, spec=TinyModelConfig(hidden_size=64, num_attention_heads=4, intermediate_size=128)).save_pretrained(checkpoint)
    tokenizer.save_pretrained(checkpoint)

    actors_before = set(ray._private.state.actors())  # the state API needs the dashboard, which is off
    remote = _rollout(checkpoint, tmp_path / "cluster.jsonl", f"ray.address={sim_cluster.address}",
                      "actor_rollout_ref.rollout.num_replicas=2", "ray.placement_strategy=STRICT_SPREAD",
                      "ray.replica_num_cpus=0.5", "actor_rollout_ref.rollout.agent.num_workers=2")
    assert remote.returncode == 0, remote.stderr[-3000:]
    assert f"Ray: joined {sim_cluster.address} with 3 node(s)" in remote.stdout + remote.stderr
    # The replicas the command started ran on two different nodes of the cluster.
    new = [a for actor_id, a in ray._private.state.actors().items()
           if actor_id not in actors_before and a["ActorClassName"] == "ReplicaActor"]
    assert len(new) == 2, new
    assert len({a["Address"]["NodeID"] for a in new}) == 2, new
    assert all(a["State"] == "DEAD" for a in new)  # stopped at the end of the command

    local = _rollout(checkpoint, tmp_path / "local.jsonl")
    assert local.returncode == 0, local.stderr[-3000:]
    on_cluster, on_one_machine = _records(tmp_path / "cluster.jsonl"), _records(tmp_path / "local.jsonl")
    assert len(on_cluster) == len(on_one_machine) == 24
    assert not any(r["failed"] for r in on_cluster)
    for a, b in zip(on_cluster, on_one_machine, strict=True):
        assert a["response_ids"] == b["response_ids"]
        assert a["response_mask"] == b["response_mask"]
