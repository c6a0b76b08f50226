"""A config written in verl's layout (examples/trainer/verl_gsm8k_multiturn.yaml) loads with one
notice per translated or ignored key and trains on the tiny model; verl's meaning of
``ppo_mini_batch_size`` (prompts, not samples) holds."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from agentloop_trainer.cli import main
from agentloop_trainer.config import ConfigError, load_config
from agentloop_trainer.data import gsm8k_row, write_parquet_rows

EXAMPLES = Path(__file__).resolve().parents[3] / "examples" / "trainer"
VERL_CONFIG = EXAMPLES / "verl_gsm8k_multiturn.yaml"
pytestmark = pytest.mark.skipif(not VERL_CONFIG.exists(), reason="needs the repository's examples/ folder")

PROBLEMS = [("Tom has 3 apples and buys 4 more. How many apples?", "3 + 4 = <<3+4=7>>7\n#### 7"),
            ("A box holds 6 pens. How many pens in 2 boxes?", "6 * 2 = <<6*2=12>>12\n#### 12"),
            ("Sam had 10 cards and gave away 3. How many are left?", "10 - 3 = <<10-3=7>>7\n#### 7"),
            ("Each bag has 5 shells; there are 3 bags. How many shells?", "5 * 3 = <<5*3=15>>15\n#### 15"),
            ("Ann reads 8 pages a day for 2 days. How many pages?", "8 * 2 = <<8*2=16>>16\n#### 16")]


def _overrides(tmp_path: Path, model_path: Path) -> list[str]:
    rows = [gsm8k_row(q, a, "train", i) for i, (q, a) in enumerate(PROBLEMS)]
    write_parquet_rows(rows[:4], tmp_path / "train.parquet")
    write_parquet_rows(rows[4:], tmp_path / "test.parquet")
    # What a user changes to run the example here: the model, the data, the engine and sizes;
    # the spellings stay verl's.
    return [
        f"actor_rollout_ref.model.path={model_path}", f"data.train_files={tmp_path / 'train.parquet'}",
        f"data.val_files={tmp_path / 'test.parquet'}", "actor_rollout_ref.rollout.name=hf",
        f"actor_rollout_ref.rollout.multi_turn.tool_config_path={EXAMPLES / 'gsm8k_tool_config.yaml'}",
        "trainer.device=cpu", "trainer.total_training_steps=2", f"trainer.default_local_dir={tmp_path / 'run'}",
        "data.train_batch_size=2", "actor_rollout_ref.actor.ppo_mini_batch_size=1", "actor_rollout_ref.rollout.n=2",
        "data.max_response_length=32", "data.max_prompt_length=512",
        "actor_rollout_ref.rollout.multi_turn.max_tokens_per_turn=8", "trainer.test_freq=-1",
        "actor_rollout_ref.actor.use_kl_loss=false", "trainer.progress_bar=false",
    ]


def test_verl_layout_loads_with_notices(tmp_path, random_model_path):
    notices: list[str] = []
    cfg = load_config(_overrides(tmp_path, random_model_path), VERL_CONFIG, notice=notices.append)
    assert cfg.model.path == str(random_model_path)
    assert cfg.trainer.total_steps == 2
    assert cfg.actor_rollout_ref.actor.lr == 1e-6
    assert cfg.trainer.run_dir == str(tmp_path / "run")
    assert cfg.actor_rollout_ref.rollout.sanity_check == "ignore_strippable"
    assert list(cfg.trainer.logger) == ["console"]  # verl's key, read as it is
    text = "\n".join(notices)
    for key in ("actor_rollout_ref.model.path", "trainer.total_training_steps", "actor_rollout_ref.actor.optim.lr",
                "trainer.default_local_dir", "multi_turn.tokenization_sanity_check_mode",
                "actor_rollout_ref.rollout.mode", "trainer.total_epochs"):
        assert key in text, f"no notice for {key}"
    assert all(line.count("\n") == 0 for line in notices)  # one line each


def test_verl_values_agentloop_cannot_honour_are_errors():
    with pytest.raises(ConfigError, match="use_kl_in_reward=True is not supported"):
        load_config(["algorithm.use_kl_in_reward=true"])
    with pytest.raises(ConfigError, match="entropy_coeff=0.01 is not supported"):
        load_config(["actor_rollout_ref.actor.entropy_coeff=0.01"])


def test_an_ignored_verl_key_is_exact_so_a_typo_is_an_error():
    notices: list[str] = []
    cfg = load_config(["actor_rollout_ref.actor.ppo_micro_batch_size=2", "critic.optim.lr_warmup_steps_ratio=0.1",
                       "actor_rollout_ref.actor.optim.lr_warmup_steps_ratio=0.1", "critic.optim.lr=1e-5"],
                      notice=notices.append)
    assert sum("ignored" in n for n in notices) == 3, notices
    assert cfg.critic.optim.lr == 1e-5  # a key of PPO's critic now, read, not ignored
    # The misspelt key once matched the ignored name ``ppo_micro_batch_size`` as a prefix and was dropped.
    with pytest.raises(ConfigError, match=r"unknown config key 'actor_rollout_ref\.actor\.ppo_micro_batch_size_per_gpuu'"):
        load_config(["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpuu=2"])


def test_ppo_mini_batch_size_counts_prompts_as_in_verl():
    from agentloop_trainer.stages import actor_config

    cfg = load_config(["data.train_batch_size=8", "actor_rollout_ref.rollout.n=4",
                       "actor_rollout_ref.actor.ppo_mini_batch_size=2"])
    assert actor_config(cfg).mini_batch_samples(32) == 8  # 2 prompts x 4 samples: 4 updates per batch
    with pytest.raises(ConfigError, match="counts prompts"):
        load_config(["data.train_batch_size=8", "actor_rollout_ref.actor.ppo_mini_batch_size=16"])


@pytest.mark.slow
def test_verl_layout_trains_two_steps(tmp_path, random_model_path):
    assert main(["train", "--config", str(VERL_CONFIG), *_overrides(tmp_path, random_model_path)]) == 0
    steps = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    train = [s for s in steps if "actor/pg_loss" in s]
    assert [s["step"] for s in train] == [1, 2]
    # ppo_mini_batch_size=1 prompt of train_batch_size=2: two optimizer steps per batch.
    assert all(s["actor/num_updates"] == 2 for s in train)
    assert all(s["rollout/num_failed"] == 0 for s in train)
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["steps"] == 2


@pytest.mark.slow
def test_all_zero_rewards_are_reported_loudly(tmp_path, random_model_path):
    """A random policy never writes '#### N': the run says so at once (the evaluation before RL)
    and again after reward.zero_reward_warn_steps steps of nothing but zeros, naming the scorer,
    the data_source and the causes."""
    from agentloop_trainer.cli import run_train

    cfg = load_config([*_overrides(tmp_path, random_model_path), "reward.zero_reward_warn_steps=2"], VERL_CONFIG,
                      notice=lambda _: None)
    logged: list[str] = []
    run_train(cfg, log=logged.append)
    assert any("every reward of the held-out evaluation before RL is 0" in line for line in logged), logged
    warnings = [line for line in logged if "every reward of the last 2 steps is 0" in line]
    assert len(warnings) == 1, logged
    assert "built-in scorer gsm8k" in warnings[0]
    assert "openai/gsm8k" in warnings[0]
    assert "a generated response" in warnings[0]
    assert "its ground truth" in warnings[0]
