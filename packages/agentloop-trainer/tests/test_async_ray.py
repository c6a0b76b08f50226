"""``trainer.mode=one_step_off|async`` on the Ray backend: engine replicas and rollout workers
are Ray actors, and the partial-rollout wrapper lives in the shared client actor that every
worker's calls pass through, driven by the trainer through the ``RemoteClient`` proxy.

Debugging a failure: ``async/tokens_version_*`` summing to zero means the workers' tokens never
reached the actor's ledger (the driver tracked ids in a different wrapper than the one the
workers generate through); a hang means a weight push that never got through the gate (see
``agentloop_engines.fleet.hosting.client_actor``: the control concurrency group).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from agentloop_trainer.config import load_config

pytestmark = [pytest.mark.ray, pytest.mark.slow]


def test_ray_backend_is_accepted_in_the_async_modes():
    for mode in ("one_step_off", "async"):
        cfg = load_config([f"trainer.mode={mode}", "actor_rollout_ref.rollout.backend=ray"])
        assert cfg.trainer.mode == mode


@pytest.mark.parametrize(("mode", "steps"), [("async", 3), ("one_step_off", 2)])
def test_async_modes_train_on_the_ray_backend(local_ray, tmp_path, random_model_path, tokenizer, mode,
                                              steps, count_trained_groups):
    """A short run completes: every step trains two whole groups of n=2 within the staleness
    bound, each token's policy version comes back from the client actor's ledger, every push
    went through the actor's gate (one update per step) and the ledger is empty at the end."""
    from transformers import AutoModelForCausalLM

    from agentloop_engines.fleet.hosting import RemoteClient
    from agentloop_trainer.stages import PolicyGradientTrainer
    from agentloop_trainer.stages.rollout_setup import run_records

    cfg = load_config([
        f"model.path={random_model_path}", f"trainer.total_steps={steps}", f"trainer.output_dir={tmp_path}",
        f"trainer.experiment_name=ray-{mode}", "trainer.test_freq=0", "trainer.save_freq=0",
        "trainer.progress_bar=false", "trainer.val_before_train=false", "data.train_size=32", "data.val_size=2",
        "data.train_batch_size=2", "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.rollout.multi_turn.max_tokens_per_turn=12", "data.max_response_length=40",
        "actor_rollout_ref.rollout.backend=ray", "actor_rollout_ref.rollout.num_replicas=2",
        "actor_rollout_ref.rollout.agent.num_workers=2", "ray.replica_num_cpus=0.25",
        f"trainer.mode={mode}",
    ])
    train, test = run_records(cfg)
    # No engine copy of the policy: the Ray replicas load it by path.
    trainer = PolicyGradientTrainer(cfg, AutoModelForCausalLM.from_pretrained(cfg.model.path), None, tokenizer, train,
                          test, Path(tmp_path) / mode, log=lambda *_: None)
    seen = count_trained_groups(trainer)
    try:
        assert isinstance(trainer.fleet.server, RemoteClient)
        assert trainer.fleet.server.partial_rollout
        assert trainer.fleet.control is trainer.fleet.server, "the driver drives the actor's wrapper"
        summary = trainer.fit()
        state = trainer.fleet.loop.run_until_complete(trainer.fleet.control.rollout_state())
    finally:
        trainer.close()
    history = [h for h in trainer.history if "actor/pg_loss" in h]
    assert summary["steps"] == steps
    assert [h["step"] for h in history] == list(range(1, steps + 1))
    for h in history:
        assert 0 <= h["staleness/max"] <= 1, h["step"]
        assert h["staleness/hist_0"] + h["staleness/hist_1"] == pytest.approx(1.0)
        assert h["rollout/num_samples"] == 4
        assert sum(v for k, v in h.items() if k.startswith("async/tokens_version_")) > 0, h
        assert 0.0 <= h["rollout/engine_idle_fraction"] <= 1.0
    assert [sorted(c.values()) for c in seen] == [[2, 2]] * steps, f"two whole groups of n=2 per step: {seen}"
    groups = trainer.async_driver.trained_groups
    trained = [i for s in sorted(groups) for i, _ in groups[s]]
    assert len(trained) == len(set(trained)) == 2 * steps
    assert (state.policy_version, state.paused, state.ledger_size) == (steps, False, 0), state
    assert state.stats["updates"] == steps, state
    if mode == "one_step_off":
        assert state.stats["interrupted_calls"] == 0, "one_step_off lets calls finish on the old weights"
