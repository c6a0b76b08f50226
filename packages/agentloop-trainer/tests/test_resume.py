"""Checkpoint + ``--resume`` reproduces the uninterrupted run's next step."""

from __future__ import annotations

import pytest

from agentloop_trainer.config import load_config


def _cfg(tmp_path, model_path, name, steps, **extra):
    overrides = [
        f"model.path={model_path}", f"trainer.total_steps={steps}", f"trainer.output_dir={tmp_path}",
        f"trainer.experiment_name={name}", "trainer.test_freq=0", "trainer.save_freq=2", "trainer.progress_bar=false",
        "data.train_size=64", "data.val_size=2", "data.train_batch_size=2", "actor_rollout_ref.rollout.n=3",
        "actor_rollout_ref.rollout.multi_turn.max_tokens_per_turn=12", "data.max_response_length=40",
        "actor_rollout_ref.actor.lr=1e-2",
    ] + [f"{k}={v}" for k, v in extra.items()]
    return load_config(overrides)


def _run(cfg, tokenizer, quiet):
    from pathlib import Path

    from transformers import AutoModelForCausalLM

    from agentloop_trainer.stages import PolicyGradientTrainer
    from agentloop_trainer.stages.rollout_setup import run_records

    train, test = run_records(cfg)
    m = AutoModelForCausalLM.from_pretrained(cfg.model.path)
    e = AutoModelForCausalLM.from_pretrained(cfg.model.path)
    trainer = PolicyGradientTrainer(cfg, m, e, tokenizer, train, test, Path(cfg.trainer.output_dir) / cfg.trainer.experiment_name,
                          log=quiet)
    try:
        trainer.fit()
    finally:
        trainer.close()
    return [h for h in trainer.history if "actor/pg_loss" in h]


@pytest.mark.slow
def test_resume_reproduces_next_step_loss(tmp_path, random_model_path, tokenizer):
    # A random policy never writes "#### N"; a custom reward function (the user's path) scores
    # the parity of the generated text's length instead, so advantages, and hence the loss,
    # depend on exactly what was sampled.
    reward = tmp_path / "parity.py"
    reward.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                      "    return float(len(solution_str) % 2)\n")
    fn = {"custom_reward_function.path": str(reward)}
    quiet = lambda *_: None  # noqa: E731
    full = _run(_cfg(tmp_path, random_model_path, "full", 3, **fn), tokenizer, quiet)
    _run(_cfg(tmp_path, random_model_path, "cut", 2, **fn), tokenizer, quiet)
    assert (tmp_path / "cut" / "checkpoints" / "step_2" / "trainer_state.pt").exists()
    assert (tmp_path / "cut" / "checkpoints" / "step_2" / "hf" / "config.json").exists()
    resumed = _run(_cfg(tmp_path, random_model_path, "cut", 3, **{"trainer.resume": "true"}, **fn), tokenizer, quiet)
    assert [h["step"] for h in full] == [1, 2, 3]
    assert resumed[-1]["step"] == 3
    # With one update per batch the PPO ratio is 1 and equal-length responses make the
    # token-mean loss ~0, so the gradient norm is the sharp check of "the same step".
    assert full[2]["actor/grad_norm"] > 1e-4, "the test needs a non-trivial gradient to mean anything"
    assert resumed[-1]["actor/pg_loss"] == pytest.approx(full[2]["actor/pg_loss"], abs=1e-6)
    assert resumed[-1]["actor/grad_norm"] == pytest.approx(full[2]["actor/grad_norm"], rel=1e-5)
    assert resumed[-1]["reward/mean"] == full[2]["reward/mean"]
    summary = (tmp_path / "full" / "summary.json").read_text()
    for key in ("eval_accuracy_before", "eval_accuracy_after", "wall_seconds", "tokens_per_second", "held_out_size"):
        assert key in summary
    assert (tmp_path / "full" / "reward_curve.png").stat().st_size > 1000
