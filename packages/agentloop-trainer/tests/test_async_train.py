"""``trainer.mode=one_step_off|async``: config checks, and short runs on the tiny policy that
complete with the staleness bound held and the per-step async metrics reported."""

from __future__ import annotations

import pytest

from agentloop_trainer.config import ConfigError, load_config, max_staleness


def test_mode_defaults_and_bounds():
    assert load_config([]).trainer.mode == "sync" and max_staleness(load_config([])) == 0
    assert max_staleness(load_config(["trainer.mode=one_step_off"])) == 1
    assert max_staleness(load_config(["trainer.mode=async"])) == 1
    assert max_staleness(load_config(["trainer.mode=async", "trainer.max_staleness=3"])) == 3


@pytest.mark.parametrize(("overrides", "message"), [
    (["trainer.mode=asynch"], "trainer.mode must be one of"),
    (["trainer.mode=one_step_off", "trainer.max_staleness=2"], "use trainer.mode=async for another bound"),
    (["trainer.max_staleness=1"], "max_staleness is 0 in trainer.mode=sync"),
    (["trainer.mode=async", "trainer.max_staleness=-1"], "must be >= 0"),
    (["trainer.mode=async", "actor_rollout_ref.rollout.name=vllm"], "rollout.name must be hf"),
    (["trainer.mode=async", "trainer.fsdp_ranks=2"], "fsdp_ranks must be 1"),
])
def test_bad_mode_settings_name_the_fix(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(overrides)


def _run(tmp_path, model_path, tokenizer, mode, steps=2):
    from pathlib import Path

    from transformers import AutoModelForCausalLM

    from agentloop_trainer.assets import load_records
    from agentloop_trainer.trainer import GRPOTrainer

    cfg = load_config([
        f"model.path={model_path}", f"trainer.total_steps={steps}", f"trainer.output_dir={tmp_path}",
        f"trainer.experiment_name={mode}", "trainer.test_freq=0", "trainer.save_freq=0", "trainer.progress_bar=false",
        "trainer.val_before_train=false", "data.train_size=32", "data.val_size=2", "data.train_batch_size=2",
        "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.rollout.multi_turn.max_tokens_per_turn=12",
        "data.max_response_length=40", f"trainer.mode={mode}",
    ])
    train, test = load_records(cfg)
    trainer = GRPOTrainer(cfg, AutoModelForCausalLM.from_pretrained(cfg.model.path),
                          AutoModelForCausalLM.from_pretrained(cfg.model.path), tokenizer, train, test,
                          Path(tmp_path) / mode, log=lambda *_: None)
    try:
        summary = trainer.fit()
    finally:
        trainer.close()
    return summary, [h for h in trainer.history if "actor/pg_loss" in h], trainer


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["one_step_off", "async"])
def test_async_modes_complete_a_short_run(tmp_path, random_model_path, tokenizer, mode):
    summary, steps, trainer = _run(tmp_path, random_model_path, tokenizer, mode)
    assert summary["steps"] == 2 and [h["step"] for h in steps] == [1, 2]
    for h in steps:
        assert 0 <= h["staleness/max"] <= 1
        assert h["staleness/hist_0"] + h["staleness/hist_1"] == pytest.approx(1.0)
        assert 0.0 <= h["async/engine_idle_fraction"] <= 1.0
        assert h["rollout/num_samples"] == 4, "two whole groups of n=2 per step"
        assert sum(v for k, v in h.items() if k.startswith("async/tokens_version_")) > 0
    assert trainer.engine.server.policy_version == 2
    assert not trainer.async_driver._tasks, "the producer and its groups stop with the run"
