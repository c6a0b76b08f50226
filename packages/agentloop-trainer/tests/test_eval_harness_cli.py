"""``agentloop eval`` over several sets and checkpoints, and the per-set metrics during training,
on the real tiny-model path (HFServer, the calculator task and GSM8K-layout rows).

A random policy never answers: every reward is 0, so the numbers are known (0 ± 0) and the test
checks the harness's plumbing, not a model."""

from __future__ import annotations

import json

from agentloop_trainer.cli import main, run_train
from agentloop_trainer.config import load_config
from agentloop_trainer.data import gsm8k_row, write_parquet_rows

TURN_CAP = "actor_rollout_ref.rollout.multi_turn.max_tokens_per_turn=8"
SAMPLED = ["actor_rollout_ref.rollout.val_kwargs.n=2", "actor_rollout_ref.rollout.val_kwargs.do_sample=true",
           "actor_rollout_ref.rollout.val_kwargs.temperature=1.0"]


def _gsm8k(tmp_path):
    """Two GSM8K-layout sets: a parquet file and GSM8K's own jsonl (3 problems, cut to 2)."""
    rows = [gsm8k_row(f"What is {i} + 1?", f"{i} + 1 = {i + 1}\n#### {i + 1}", "test", i) for i in range(2)]
    for r in rows:
        r["data_source"] = "my/gsm8k"
        r["extra_info"].pop("tools_kwargs")  # the built-in calculator tools have no check_answer
    write_parquet_rows(rows, tmp_path / "other.parquet")
    jsonl = tmp_path / "test.jsonl"
    jsonl.write_text("".join(json.dumps({"question": f"What is {i} * 2?", "answer": f"#### {2 * i}"}) + "\n"
                             for i in range(3)))
    return tmp_path / "other.parquet", jsonl


def test_eval_prints_one_table_for_sets_and_checkpoints_and_writes_json(tmp_path, random_model_path, capsys):
    parquet, _ = _gsm8k(tmp_path)
    out = tmp_path / "eval.json"
    code = main(["eval", str(random_model_path), str(random_model_path), "--data", str(parquet), "--out", str(out),
                 "--no-progress", "data.max_response_length=40", TURN_CAP, *SAMPLED])
    printed = capsys.readouterr().out
    assert code == 0, printed
    lines = [line for line in printed.splitlines() if "my/gsm8k" in line]
    assert len(lines) == 2, printed  # one row per checkpoint x set
    assert lines[0].split()[2:] == ["2", "2", *["0.000", "±", "0.000"] * 4, "0"]
    assert "pass@1         pass@k         avg@k          maj@k" in printed
    data = json.loads(out.read_text())
    assert data["settings"]["n"] == 2
    assert data["settings"]["k"] == [1, 2]
    (first, second) = data["results"]
    assert (first["data_source"], first["problems"], first["n"]) == ("my/gsm8k", 2, 2)
    assert set(first["metrics"]) == {"pass@1", "pass@2", "avg@2", "maj@2"}
    assert first["metrics"]["pass@2"] == {"mean": 0.0, "se": 0.0}


def test_eval_reads_gsm8k_jsonl_with_a_limit_and_the_built_in_set(tmp_path, random_model_path, capsys):
    _, jsonl = _gsm8k(tmp_path)
    out = tmp_path / "e.json"
    # check_answer is not a tool of the built-in config: those samples fail, counted, not dropped.
    code = main(["eval", str(random_model_path), "--data", str(jsonl), "--limit", "2", "--out", str(out),
                 "--no-progress", "data.max_response_length=40", TURN_CAP, *SAMPLED])
    printed = capsys.readouterr().out
    assert code == 1
    assert "agentloop eval: all 4 samples failed" in printed
    assert json.loads(out.read_text())["results"] == []
    code = main(["eval", str(random_model_path), "--no-progress", "data.val_size=2", "data.max_response_length=40",
                 TURN_CAP, *SAMPLED])
    printed = capsys.readouterr().out
    assert code == 0
    assert "agentloop/calculator  2         2  0.000 ± 0.000" in printed


def test_eval_usage_errors_are_one_line(tmp_path, random_model_path, capsys):
    assert main(["eval", str(random_model_path), "-k", "4", *SAMPLED]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("agentloop eval: k=4 needs at least 4 samples per problem but actor_rollout_ref.rollout."
                   "val_kwargs.n=2; raise val_kwargs.n or ask for k <= 2")
    assert main(["eval", str(random_model_path), "--data", str(tmp_path / "nope.parquet")]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"agentloop eval: {tmp_path / 'nope.parquet'}: no such file (a parquet file in verl's layout, "
                   "or GSM8K's test.jsonl)")
    assert main(["eval", str(tmp_path)]) == 2
    assert "is not a Hugging Face checkpoint folder (no config.json)" in capsys.readouterr().err


def test_training_logs_every_sets_metrics_at_test_freq_and_at_the_end(tmp_path, random_model_path):
    parquet, _ = _gsm8k(tmp_path)
    cfg = load_config([f"model.path={random_model_path}", f"trainer.run_dir={tmp_path / 'run'}",
                       "trainer.total_steps=2", "trainer.test_freq=1", "trainer.progress_bar=false",
                       f"data.train_files={parquet}", f"data.val_files=[{parquet},{parquet}]",
                       "data.train_batch_size=2", "actor_rollout_ref.rollout.n=2", "data.max_response_length=40",
                       TURN_CAP, *SAMPLED])
    run_train(cfg)
    history = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    evals = [h for h in history if "val/my/gsm8k/pass@1" in h]
    # before RL, at step 1 (test_freq; step 2 is the last, evaluated once at the end), after RL
    assert [h["step"] for h in evals] == [0, 1, 2]
    assert evals[-1]["val/my/gsm8k/problems"] == 4.0  # the list of two files: both read
    assert {"val/my/gsm8k/pass@2", "val/my/gsm8k/avg@2", "val/my/gsm8k/maj@2", "val/my/gsm8k/pass@1/se"} <= set(evals[-1])


def test_eval_reads_the_host_mmap_threshold_as_train_does(random_model_path, monkeypatch, capsys):
    """``trainer.host_mmap_threshold_mb`` is the process's allocator setting for ``agentloop
    eval`` too (it was read by ``agentloop train`` alone, and ignored here without a word)."""
    import agentloop_trainer.stages.memory as memory

    set_to: list[int] = []
    monkeypatch.setattr(memory, "map_large_blocks", lambda threshold: set_to.append(threshold) or True)
    assert main(["eval", str(random_model_path), "--no-progress", "data.val_size=2", "data.max_response_length=40",
                 TURN_CAP, "trainer.host_mmap_threshold_mb=8"]) == 0
    assert set_to == [8 << 20]
    assert main(["eval", str(random_model_path), "--no-progress", "data.val_size=2", "data.max_response_length=40",
                 TURN_CAP]) == 0
    assert set_to == [8 << 20]  # unset: glibc's adaptive threshold is left alone
    capsys.readouterr()
