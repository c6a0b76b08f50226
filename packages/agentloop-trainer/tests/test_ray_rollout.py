"""The trainer's ray rollout backend: replicas and workers as Ray actors give the in-process
result for the same seeds; `agentloop train` runs on it; unmet resources fail before start."""

from __future__ import annotations

import json

import numpy as np
import pytest

pytestmark = [pytest.mark.ray, pytest.mark.slow]


def _cfg(model_path, *extra):
    from agentloop_trainer.config import load_config

    return load_config([
        f"model.path={model_path}", "data.train_size=64", "data.val_size=4", "data.train_batch_size=2",
        "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.rollout.multi_turn.max_tokens_per_turn=12",
        "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=2", "data.max_response_length=40",
        "trainer.progress_bar=false", "ray.replica_num_cpus=0.25", *extra,
    ])


def test_ray_backend_equals_in_process_for_the_same_seed(local_ray, random_model_path, tokenizer):
    from transformers import AutoModelForCausalLM

    from agentloop_trainer.rollout import make_rows
    from agentloop_trainer.stages.rollout_setup import rollout_fleet, run_records

    cfg = _cfg(random_model_path, "actor_rollout_ref.rollout.backend=ray", "actor_rollout_ref.rollout.num_replicas=2",
               "actor_rollout_ref.rollout.agent.num_workers=2", "trainer.seed=7",
               "ray.placement_strategy=SPREAD")
    local_cfg = _cfg(random_model_path, "trainer.seed=7")
    rows = make_rows(run_records(cfg)[0][:6], 4, step=3)
    batches = []
    for on_ray in (False, True):
        model = None if on_ray else AutoModelForCausalLM.from_pretrained(random_model_path)
        engine = rollout_fleet(cfg if on_ray else local_cfg, random_model_path, tokenizer, model, name="eq")
        try:
            batches.append(engine.generate(rows, step=3))
            if on_ray:
                stats = engine.loop.run_until_complete(engine.server.get_stats())
        finally:
            engine.close()
    local, remote = batches
    assert local.num_failed == 0
    assert remote.num_failed == 0
    np.testing.assert_array_equal(local.responses, remote.responses)
    np.testing.assert_array_equal(local.response_mask, remote.response_mask)
    np.testing.assert_allclose(local.rollout_log_probs, remote.rollout_log_probs, atol=1e-4)
    # Both replicas served: equality is not an accident of one replica doing everything.
    assert len(stats["per_replica"]) == 2, stats
    assert min(stats["per_replica"]) > 0, stats
    # close() stopped the replicas.
    assert not [a for a in local_ray.util.list_named_actors(all_namespaces=True) if "eq-engine" in str(a)]


def test_agentloop_train_on_the_ray_backend(local_ray, random_model_path, tmp_path):
    from agentloop_trainer.cli import run_train

    cfg = _cfg(random_model_path, "actor_rollout_ref.rollout.backend=ray", "actor_rollout_ref.rollout.num_replicas=2",
               "trainer.total_steps=2", "trainer.test_freq=0", "trainer.save_freq=0", f"trainer.output_dir={tmp_path}",
               "trainer.experiment_name=ray")
    logged: list[str] = []
    run_dir, summary = run_train(cfg, log=logged.append)
    assert summary["steps"] == 2
    assert 0.0 <= summary["eval_accuracy_after"] <= 1.0
    assert any(line.startswith("Ray: local cluster with 1 node(s)") for line in logged), logged
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics if "reward/mean" in m] == [1, 2]
    # the Ray pool's accounting reaches metrics.jsonl (no worker died here)
    assert [m["rollout/worker_failures"] for m in metrics if "reward/mean" in m] == [0, 0]
    # the shared client actor times every worker's engine calls: idle for at least the update
    # and the push, which no call overlaps in sync mode
    for m in (m for m in metrics if "reward/mean" in m):
        quiet = (m["timing_s/update"] + m["timing_s/sync_weights"]) / m["timing_s/step"]
        assert quiet <= m["rollout/engine_idle_fraction"] < 1.0, m
    assert local_ray.is_initialized()  # a cluster the run did not start is left running


def test_unmet_replica_resources_fail_before_anything_starts(local_ray, random_model_path, tmp_path):
    from agentloop_engines.fleet.hosting import InsufficientResourcesError
    from agentloop_trainer.cli import run_train

    cfg = _cfg(random_model_path, "actor_rollout_ref.rollout.backend=ray", "ray.replica_num_gpus=1",
               "trainer.total_steps=1", f"trainer.output_dir={tmp_path}")
    before = len(local_ray.util.list_named_actors(all_namespaces=True))
    with pytest.raises(InsufficientResourcesError, match="GPU"):
        run_train(cfg, log=lambda *_: None)
    assert len(local_ray.util.list_named_actors(all_namespaces=True)) == before
