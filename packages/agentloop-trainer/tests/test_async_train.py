"""``trainer.mode=one_step_off|async``: config checks, and short runs on the tiny policy that
complete with the staleness bound held and the per-step async metrics reported."""

from __future__ import annotations

import pytest

from agentloop_trainer.config import ConfigError, load_config, max_staleness


def test_mode_defaults_and_bounds():
    assert load_config([]).trainer.mode == "sync"
    assert max_staleness(load_config([])) == 0
    assert max_staleness(load_config(["trainer.mode=one_step_off"])) == 1
    assert max_staleness(load_config(["trainer.mode=async"])) == 1
    assert max_staleness(load_config(["trainer.mode=async", "trainer.max_staleness=3"])) == 3


@pytest.mark.parametrize(("overrides", "message"), [
    (["trainer.mode=asynch"], "trainer.mode must be one of"),
    (["trainer.mode=one_step_off", "trainer.max_staleness=2"], "use trainer.mode=async for another bound"),
    (["trainer.max_staleness=1"], "max_staleness is 0 in trainer.mode=sync"),
    (["trainer.mode=async", "trainer.max_staleness=-1"], "must be >= 0"),
    (["trainer.mode=async", "actor_rollout_ref.rollout.name=sglang"], "rollout.name must be one of"),
])
def test_bad_mode_settings_name_the_fix(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(overrides)


def _run(tmp_path, model_path, tokenizer, mode, steps=2, extra=(), spy=None):
    from pathlib import Path

    from transformers import AutoModelForCausalLM

    from agentloop_trainer.stages import PolicyGradientTrainer
    from agentloop_trainer.stages.rollout_setup import run_records

    cfg = load_config([
        f"model.path={model_path}", f"trainer.total_steps={steps}", f"trainer.output_dir={tmp_path}",
        f"trainer.experiment_name={mode}", "trainer.test_freq=0", "trainer.save_freq=0", "trainer.progress_bar=false",
        "trainer.val_before_train=false", "data.train_size=32", "data.val_size=2", "data.train_batch_size=2",
        "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.rollout.multi_turn.max_tokens_per_turn=12",
        "data.max_response_length=40", f"trainer.mode={mode}", *extra,
    ])
    train, test = run_records(cfg)
    trainer = PolicyGradientTrainer(cfg, AutoModelForCausalLM.from_pretrained(cfg.model.path),
                          AutoModelForCausalLM.from_pretrained(cfg.model.path), tokenizer, train, test,
                          Path(tmp_path) / mode, log=lambda *_: None)
    if spy is not None:
        spy(trainer)
    try:
        summary = trainer.fit()
    finally:
        trainer.close()
    return summary, [h for h in trainer.history if "actor/pg_loss" in h], trainer


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["one_step_off", "async"])
def test_async_modes_complete_a_short_run(tmp_path, random_model_path, tokenizer, mode):
    summary, steps, trainer = _run(tmp_path, random_model_path, tokenizer, mode)
    assert summary["steps"] == 2
    assert [h["step"] for h in steps] == [1, 2]
    for h in steps:
        assert 0 <= h["staleness/max"] <= 1
        assert h["staleness/hist_0"] + h["staleness/hist_1"] == pytest.approx(1.0)
        assert 0.0 <= h["rollout/engine_idle_fraction"] <= 1.0
        assert h["rollout/num_samples"] == 4, "two whole groups of n=2 per step"
        assert sum(v for k, v in h.items() if k.startswith("async/tokens_version_")) > 0
    assert trainer.fleet.server.policy_version == 2
    assert not trainer.async_driver._tasks, "the producer and its groups stop with the run"


@pytest.mark.slow
def test_longer_async_run_keeps_the_bound_whole_groups_and_an_empty_ledger(tmp_path, random_model_path, tokenizer,
                                                                           count_trained_groups):
    """Six steps of ``trainer.mode=async`` with ``max_staleness=2`` and evaluations before,
    during and after: at every step the staleness stays within the bound and the update sees
    ``train_batch_size`` whole groups of ``rollout.n`` trajectories; every group is trained at
    most once and none is skipped; the partial-rollout ledger is empty at the end (evaluation
    rollouts go through the same engine and must leave nothing in it)."""
    spied = []
    summary, steps, trainer = _run(
        tmp_path, random_model_path, tokenizer, "async", steps=6, spy=lambda t: spied.append(count_trained_groups(t)),
        extra=("trainer.max_staleness=2", "trainer.val_before_train=true", "trainer.test_freq=2"))
    assert summary["steps"] == 6
    assert [h["step"] for h in steps] == [1, 2, 3, 4, 5, 6]
    assert sum("eval/accuracy" in h for h in trainer.history) == 4, "before, at steps 2 and 4, after"
    for h in steps:
        assert 0 <= h["staleness/max"] <= 2, h["step"]
        assert sum(h[f"staleness/hist_{k}"] for k in range(3)) == pytest.approx(1.0)
    seen = spied[0]
    assert len(seen) == 6
    for counts in seen:
        assert len(counts) == 2, f"two whole groups of n=2 per step: {counts}"
        assert set(counts.values()) == {2}, f"two whole groups of n=2 per step: {counts}"
    driver = trainer.async_driver
    trained = [i for s in sorted(driver.trained_groups) for i, _ in driver.trained_groups[s]]
    assert len(trained) == len(set(trained)) == 12
    left = {g.index for g in driver.buffer.open_groups}
    assert set(trained) | left == set(range(driver.buffer.started)), "no started group is lost"
    assert trainer.fleet.server.ledger_size == 0


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["async", "one_step_off"])
def test_async_modes_on_two_fsdp_ranks_push_the_whole_policy(tmp_path, random_model_path, mode):
    """``agentloop train`` on 2 gloo ranks in an asynchronous mode: rank 0 rolls out while both
    ranks update their shards, then both take part in gathering each tensor that rank 0 pushes.

    With ``max_staleness=0`` (async) every trained token was sampled by the weights the update
    starts from, so the rollout's log-probs must equal the update's own forward pass: a push
    that missed a shard or a step would show up as a gap once the policy moves (the parity
    reward gives a random policy advantages, so it does). one_step_off trains tokens of the
    version before, so there only the bound and whole groups are checked."""
    import json

    from agentloop_trainer.cli import run_train

    reward = tmp_path / "parity.py"
    reward.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                      "    return float(len(solution_str) % 2)\n")
    cfg = load_config([
        f"model.path={random_model_path}", "data.train_size=32", "data.val_size=2", "data.train_batch_size=2",
        "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.rollout.multi_turn.max_tokens_per_turn=12",
        "data.max_response_length=40", "actor_rollout_ref.actor.lr=1e-2", "trainer.fsdp_ranks=2",
        "trainer.total_steps=3", "trainer.test_freq=0", "trainer.save_freq=0", "trainer.progress_bar=false",
        "trainer.val_before_train=false", f"trainer.output_dir={tmp_path}", f"trainer.experiment_name={mode}",
        f"custom_reward_function.path={reward}", f"trainer.mode={mode}",
        *(["trainer.max_staleness=0"] if mode == "async" else []),
    ])
    run_dir, summary = run_train(cfg, log=lambda *_: None)
    assert summary["steps"] == 3
    assert summary["fsdp_ranks"] == 2
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in steps if "actor/pg_loss" in m]
    assert [m["step"] for m in steps] == [1, 2, 3]
    bound = 0 if mode == "async" else 1
    for m in steps:
        assert m["rollout/num_samples"] == 4, "two whole groups of n=2 per step"
        assert m["staleness/max"] <= bound
        assert m["rollout/num_failed"] == 0
    assert any(m["actor/grad_norm"] > 0 for m in steps[:-1]), "the policy must move for the check to mean anything"
    if mode == "async":
        gaps = [m["rollout/logprob_abs_diff_max"] for m in steps]
        assert max(gaps) < 1e-3, f"rollout log-probs differ from the trained policy's: {gaps}"


@pytest.mark.slow
def test_sync_steps_report_the_engine_idle_fraction(tmp_path, random_model_path, tokenizer):
    """In sync mode the engine has no call in flight during the update and the weight push, so
    a step's idle fraction is at least their share of the step; the busy time is the union of
    the calls' lifetimes (their sum would exceed the rollout phase and drive it to 0)."""
    _, steps, _ = _run(tmp_path, random_model_path, tokenizer, "sync")
    for h in steps:
        idle = h["rollout/engine_idle_fraction"]
        quiet = (h["timing_s/update"] + h["timing_s/sync_weights"]) / h["timing_s/step"]
        assert quiet <= idle < 1.0, (idle, quiet)
