"""What a run tells its user, on the real tiny-model path (HFServer, the built-in calculator task
or GSM8K-layout parquet rows): the zero-reward hint at once, truncation per cause in the
metrics, the turn-cap warning, the final Hugging Face folder whatever ``trainer.save_freq``,
"before" absent without a pre-RL evaluation, and ``agentloop eval`` / ``rollout`` exit codes
when samples fail.

A random policy never answers and never stops within a few tokens, so every reward is 0 and
every turn runs into an 8-token cap: exactly the run the warnings are for."""

from __future__ import annotations

import json

import pytest

from agentloop_trainer.cli import main, run_train
from agentloop_trainer.config import load_config
from agentloop_trainer.data import gsm8k_row, write_parquet_rows

TURN_CAP_KEY = "actor_rollout_ref.rollout.multi_turn.max_tokens_per_turn"


def _overrides(tmp_path, model_path, *extra):
    return [f"model.path={model_path}", f"trainer.run_dir={tmp_path / 'run'}", "trainer.total_steps=1",
            "trainer.progress_bar=false", "trainer.test_freq=0", "data.train_size=16", "data.val_size=2",
            "data.train_batch_size=2", "actor_rollout_ref.rollout.n=2", f"{TURN_CAP_KEY}=8",
            "data.max_response_length=40", *extra]


def test_first_step_hint_truncation_metrics_and_final_folder(tmp_path, random_model_path):
    logged: list[str] = []
    run_dir, summary = run_train(load_config(_overrides(tmp_path, random_model_path, "trainer.save_freq=0")),
                                 log=logged.append)
    text = "\n".join(logged)
    # The pre-RL evaluation already shows every reward 0: said at once, with the causes and their keys.
    hint = next(line for line in logged if "every reward of the held-out evaluation before RL is 0" in line)
    assert "reward.answer_format.calculator=flexible" in hint
    assert "only '#### N'" in hint
    assert f"of turns cut by {TURN_CAP_KEY}=8" in hint
    assert "a generated response" in hint
    assert "its ground truth" in hint
    assert "every reward of step 1 is 0 too" in text  # and step 1 refers to it
    warnings = [line for line in logged if "were cut at 8 tokens by " + TURN_CAP_KEY in line]
    assert len(warnings) == 1, logged  # once per run, not every step

    step = next(json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()
                if "actor/pg_loss" in line)
    assert step["rollout/truncated/turn_cap_turns"] > 0.5
    assert step["rollout/truncated/turn_cap"] > 0.5
    assert step["rollout/truncated/response_budget"] == 0
    assert step["rollout/truncated/context"] == 0
    assert step["rollout/response_clip_fraction"] == 0  # measured against the 40-token budget

    # save_freq=0 writes no checkpoint, but the run still ends with a loadable policy folder.
    final = run_dir / "final" / "hf"
    assert summary["final_hf_dir"] == str(final)
    assert not (run_dir / "checkpoints").exists()
    from transformers import AutoModelForCausalLM

    assert AutoModelForCausalLM.from_pretrained(final).config.vocab_size > 0
    assert json.loads((run_dir / "summary.json").read_text())["final_hf_dir"] == str(final)
    assert summary["eval_accuracy_before"] == 0.0
    assert summary["per_template_before"] is not None


def test_no_pre_rl_eval_reads_as_absent(tmp_path, random_model_path, capsys):
    args = _overrides(tmp_path, random_model_path, "trainer.val_before_train=false", "trainer.save_freq=1")
    assert main(["train", *args]) == 0
    out = capsys.readouterr().out
    assert "held-out accuracy - -> 0.000" in out
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["eval_accuracy_before"] is None
    assert summary["per_template_before"] is None
    assert summary["eval_accuracy_after"] == 0.0
    # The last checkpoint's folder is the final one; nothing is written twice.
    assert summary["final_hf_dir"] == str(tmp_path / "run" / "checkpoints" / "step_1" / "hf")
    assert not (tmp_path / "run" / "final").exists()
    assert f"final model (Hugging Face folder): {tmp_path / 'run' / 'checkpoints' / 'step_1' / 'hf'}" in out


@pytest.mark.parametrize(("extra", "cause"), [
    ([], "rollout/truncated/turn_cap"),
    (["data.max_response_length=6"], "rollout/truncated/response_budget"),
    # The prompts render to ~356-358 tokens: 4-6 tokens of context left, fewer than the cap asks for.
    (["actor_rollout_ref.rollout.max_model_len=362"], "rollout/truncated/context"),
])
def test_each_truncation_cause_on_the_real_engine(tmp_path, random_model_path, extra, cause):
    from agentloop_trainer.cli import evaluate_checkpoint

    result = evaluate_checkpoint(load_config(_overrides(tmp_path, random_model_path, *extra)), random_model_path)
    causes = ("rollout/truncated/turn_cap", "rollout/truncated/response_budget", "rollout/truncated/context")
    assert {c: result.metrics[c] for c in causes} == {c: 1.0 if c == cause else 0.0 for c in causes}
    assert result.num_failed == 0


def _gsm8k_files(tmp_path, with_tool_kwargs: list[bool]) -> list[str]:
    rows = [gsm8k_row(f"Tom has {i} apples and buys 2 more. How many apples?", f"#### {i + 2}", "test", i)
            for i in range(len(with_tool_kwargs))]
    for row, keep in zip(rows, with_tool_kwargs, strict=True):
        if not keep:
            row["extra_info"].pop("tools_kwargs")
    write_parquet_rows(rows, tmp_path / "test.parquet")
    # No tool config: a row whose tools_kwargs names check_answer fails (the loop has no such tool).
    return [f"data.train_files={tmp_path / 'test.parquet'}", f"data.val_files={tmp_path / 'test.parquet'}",
            "actor_rollout_ref.rollout.n=1", "actor_rollout_ref.rollout.val_kwargs.n=1", f"{TURN_CAP_KEY}=4"]


@pytest.mark.parametrize("command", ["eval", "rollout"])
def test_cli_exits_1_when_every_sample_failed(tmp_path, random_model_path, capsys, command):
    extra = ["--out", str(tmp_path / "r.jsonl"), "--num-prompts", "2"] if command == "rollout" else []
    assert main([command, str(random_model_path), *extra, *_gsm8k_files(tmp_path, [True, True])]) == 1
    out = capsys.readouterr().out
    assert f"agentloop {command}: all 2 samples failed" in out
    assert "2 x ValueError: row tools_kwargs names tools ['check_answer'] that the loop does not have" in out
    assert "held-out accuracy" not in out  # no accuracy made of failures


@pytest.mark.parametrize("command", ["eval", "rollout"])
def test_cli_reports_some_failed_and_exits_0(tmp_path, random_model_path, capsys, command):
    extra = ["--out", str(tmp_path / "r.jsonl"), "--num-prompts", "2"] if command == "rollout" else []
    assert main([command, str(random_model_path), *extra, *_gsm8k_files(tmp_path, [True, False])]) == 0
    out = capsys.readouterr().out
    assert f"agentloop {command}: 1 of 2 samples failed (scored 0)" in out
    assert "1 x ValueError: row tools_kwargs names tools ['check_answer']" in out
