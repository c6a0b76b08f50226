"""Dataset loading: malformed parquet rows named by number, overlong prompts dropped with a
count or rejected, the GSM8K download's offline error."""

from __future__ import annotations

import pytest

from agentloop_trainer.cli import main
from agentloop_trainer.config import load_config
from agentloop_trainer.data import gsm8k_row, prompt_lengths, read_parquet_rows, write_parquet_rows
from agentloop_trainer.task import tool_schemas


def _rows(n: int) -> list[dict]:
    return [gsm8k_row(f"What is {i} + {i}?", f"#### {2 * i}", "train", i) for i in range(n)]


def test_malformed_rows_after_the_first_are_named(tmp_path):
    rows = _rows(6)
    rows[3]["prompt"] = [{"role": "user"}]  # no content
    rows[5]["reward_model"] = {"style": "rule", "ground_truth": ""}
    path = write_parquet_rows(rows, tmp_path / "bad.parquet")
    with pytest.raises(ValueError, match=r"2 of 6 rows are malformed: row 3: prompt message 0 needs a string "
                                         r"'role' and 'content' \(a string or a list of text parts\); row 5: 'reward_model.ground_truth' is missing"):
        read_parquet_rows(path)
    assert len(read_parquet_rows(write_parquet_rows(_rows(6), tmp_path / "good.parquet"))) == 6


def test_overlong_prompts_are_measured_with_the_tool_schemas_and_dropped_or_rejected(tmp_path, tokenizer):
    from agentloop_trainer.stages.rollout_setup import run_records

    rows = _rows(4)
    rows[2]["prompt"][1]["content"] = "How many? " * 80
    train = write_parquet_rows(rows, tmp_path / "train.parquet")
    test = write_parquet_rows(_rows(2), tmp_path / "test.parquet")
    with_tools = prompt_lengths(rows, tokenizer, tool_schemas())
    without = prompt_lengths(rows, tokenizer, None)
    assert all(a > b + 50 for a, b in zip(with_tools, without, strict=True))  # schemas are counted
    limit = sorted(with_tools)[-2]  # every prompt but the long one fits
    from agentloop_trainer.task import BUILTIN_TOOL_CONFIG

    # The configured tools' schemas count: here the calculator's, as a user's tool YAML names it.
    overrides = [f"data.train_files={train}", f"data.val_files={test}", f"data.max_prompt_length={limit}",
                 f"actor_rollout_ref.rollout.multi_turn.tool_config_path={BUILTIN_TOOL_CONFIG}"]
    stats: dict[str, int] = {}
    logged: list[str] = []
    kept, held = run_records(load_config(overrides), tokenizer, logged.append, stats)
    assert [r["extra_info"]["index"] for r in kept] == [0, 1, 3]
    assert len(held) == 2
    assert stats == {"data/dropped_overlong_train": 1, "data/dropped_overlong_val": 0}
    assert "dropped 1 of 4 prompts longer than data.max_prompt_length" in logged[0]
    with pytest.raises(ValueError, match=rf"1 prompts exceed data.max_prompt_length={limit} .*row 2 "
                                         rf"\({with_tools[2]} tokens\).*filter_overlong_prompts=true"):
        run_records(load_config([*overrides, "data.filter_overlong_prompts=false"]), tokenizer)


def test_gsm8k_without_jsonl_offline_names_the_fix(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants as hub_constants

    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))  # nothing cached
    assert main(["data", "gsm8k", "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "cannot download openai/gsm8k (train)" in err
    assert "pass --from-jsonl DIR" in err
    assert not (tmp_path / "out").exists()
