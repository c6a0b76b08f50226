"""Config errors name the key and the closest valid one; the CLI and the GSM8K converter."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from agentloop_trainer.cli import main
from agentloop_trainer.config import ConfigError, load_config

SHARED_GSM8K = Path(__file__).resolve().parents[3] / ".." / "shared" / "data" / "gsm8k"


def test_defaults_and_overrides():
    cfg = load_config(["actor_rollout_ref.rollout.n=4", "algorithm.adv_estimator=dr_grpo", "data.train_files=x.parquet"])
    assert cfg.actor_rollout_ref.rollout.n == 4
    assert cfg.algorithm.adv_estimator == "dr_grpo"
    assert cfg.data.train_files == "x.parquet"
    assert cfg.actor_rollout_ref.rollout.multi_turn.max_assistant_turns == 3
    assert cfg.actor_rollout_ref.rollout.agent.num_workers == 1
    assert load_config().trainer.fsdp_ranks == 1


@pytest.mark.parametrize(("key", "closest"), [
    ("actor_rollout_ref.rollout.temprature", "actor_rollout_ref.rollout.temperature"),
    ("data.train_file", "data.train_files"),
    ("trainer.total_step", "trainer.total_steps"),
])
def test_unknown_key_names_closest(key, closest):
    with pytest.raises(ConfigError, match=rf"unknown config key '{key}'; did you mean '{closest}'"):
        load_config([f"{key}=1"])


def test_wrong_type_and_choice_are_errors(tmp_path):
    with pytest.raises(ConfigError, match="total_steps"):
        load_config(["trainer.total_steps=many"])
    with pytest.raises(ConfigError, match="adv_estimator"):
        load_config(["algorithm.adv_estimator=ppo"])
    bad = tmp_path / "bad.yaml"
    bad.write_text("trainer:\n  totl_steps: 3\n")
    with pytest.raises(ConfigError, match="trainer.total_steps"):
        load_config([], bad)


@pytest.mark.parametrize("value", ["2", "0", "1", "2.0", "'yes please'"])
def test_a_bool_key_takes_true_or_false_only(value, tmp_path):
    # OmegaConf alone turns 2 into True: a number meant for another key must not pass silently.
    key = "actor_rollout_ref.rollout.val_kwargs.do_sample"
    with pytest.raises(ConfigError, match=rf"{key}"):
        load_config([f"{key}={value}"])
    in_file = tmp_path / "bad.yaml"
    in_file.write_text(f"actor_rollout_ref:\n  rollout:\n    val_kwargs:\n      do_sample: {value}\n")
    with pytest.raises(ConfigError, match=rf"{key}"):
        load_config([], in_file)


@pytest.mark.parametrize(("value", "expected"), [("true", True), ("False", False), ("yes", True), ("off", False)])
def test_a_bool_key_takes_the_yaml_words(value, expected):
    cfg = load_config([f"actor_rollout_ref.rollout.val_kwargs.do_sample={value}"])
    assert cfg.actor_rollout_ref.rollout.val_kwargs.do_sample is expected


def test_cli_show_config_and_bad_key(capsys):
    assert main(["train", "--show-config", "trainer.total_steps=7"]) == 0
    assert "total_steps: 7" in capsys.readouterr().out
    assert main(["train", "trainer.totl_steps=7"]) == 2
    assert "did you mean 'trainer.total_steps'" in capsys.readouterr().err


def test_gsm8k_conversion_reports_malformed_lines(tmp_path, capsys):
    src = tmp_path / "src"
    src.mkdir()
    good = {"question": "What is 2 + 3?", "answer": "2 + 3 = <<2+3=5>>5\n#### 5"}
    (src / "train.jsonl").write_text(
        json.dumps(good) + "\n" + "{not json\n" + json.dumps({"question": "q", "answer": "no final"}) + "\n"
        + json.dumps({"question": "q2", "answer": "#### 1,200"}) + "\n"
    )
    (src / "test.jsonl").write_text(json.dumps(good) + "\n")
    assert main(["data", "gsm8k", "--from-jsonl", str(src), "--out", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    assert "train: 2 rows written, 2 malformed" in out
    assert "line 2: not JSON" in out
    assert "line 3: answer has no '#### N'" in out
    from agentloop_trainer.data import read_parquet_rows

    rows = read_parquet_rows(tmp_path / "out" / "train.parquet")
    assert [r["reward_model"]["ground_truth"] for r in rows] == ["5", "1200"]
    assert rows[0]["agent_name"] == "tool_agent"
    assert rows[0]["data_source"] == "openai/gsm8k"
    assert rows[0]["prompt"][1] == {"role": "user", "content": "What is 2 + 3?"}
    assert rows[0]["extra_info"]["tools_kwargs"] == {"check_answer": {"create_kwargs": {"ground_truth": "5"}}}


@pytest.mark.skipif(not SHARED_GSM8K.exists(), reason="GSM8K jsonl is only at ../shared/data/gsm8k in the dev checkout")
def test_real_gsm8k_converts(tmp_path):
    from agentloop_trainer.data import convert_gsm8k, read_parquet_rows

    counts = convert_gsm8k(SHARED_GSM8K, tmp_path)
    assert counts["train"][0] > 7000
    assert counts["test"][0] > 1000
    rows = read_parquet_rows(tmp_path / "test.parquet")
    assert all(float(r["reward_model"]["ground_truth"]) == float(r["reward_model"]["ground_truth"]) for r in rows[:50])
