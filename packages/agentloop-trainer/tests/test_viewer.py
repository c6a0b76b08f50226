"""The trajectory viewer without a browser: the records the trainer and `agentloop rollout` write,
and the HTML generator's structure, counts and self-containedness (test_viewer_browser.py opens
the same page in Chromium)."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from agentloop_core.batch import RolloutBatch
from agentloop_core.output import AgentLoopOutput
from agentloop_trainer.view import (
    group_trajectories,
    render_html,
    sample_rows,
    summarize,
    trajectory_records,
    write_step_trajectories,
)
from agentloop_trainer.view.viewer import load_records


def sample_batch(tokenizer):
    """Four trajectories: 0 with a tool call (reward 1), 1 in two segments (reward 0), 2 failed,
    3 flagged by the sanity check; rows as ``make_rows`` makes them (group = prompt)."""
    enc = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    prompt = enc("What is 2 + 3?")
    call, result, answer = enc("calc(2+3)"), enc(" result: 5 "), enc("#### 5")
    messages = [
        {"role": "user", "content": "What is 2 + 3?"},
        {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {
            "name": "calculator", "arguments": {"expression": "2+3"}}}]},
        {"role": "tool", "content": "5"},
        {"role": "assistant", "content": "#### 5"},
    ]
    lp = lambda n, v: [v] * n  # noqa: E731
    outputs = [
        AgentLoopOutput(prompt, call + result + answer, [1] * len(call) + [0] * len(result) + [1] * len(answer),
                        lp(len(call), -0.25) + lp(len(result), 0.0) + lp(len(answer), -1.5), reward_score=1.0,
                        num_turns=4, metrics={"tool_calls": 1}, extra_fields={"messages": messages},
                        trajectory_index=0),
        AgentLoopOutput(prompt, call, [1] * len(call), lp(len(call), -0.5), reward_score=0.0,
                        metrics={"tool_calls": 1}, trajectory_index=1, segment_index=0),
        AgentLoopOutput(enc("summary"), answer, [1] * len(answer), lp(len(answer), -2.0), reward_score=0.0,
                        metrics={"tool_calls": 1}, trajectory_index=1, segment_index=1),
        AgentLoopOutput.failure(prompt, "TimeoutError: the tool hung", trajectory_index=2),
        AgentLoopOutput(prompt, answer, [1] * len(answer), lp(len(answer), -0.1), reward_score=0.5,
                        metrics={"tokenization_mismatch": 1}, trajectory_index=3),
    ]
    rows = [{"group_id": f"train-1-{t // 2}", "rollout_n": t % 2, "ground_truth": "5", "data_source": "calc"}
            for t in range(4)]
    return RolloutBatch.from_outputs(outputs, pad_token_id=0), rows


def sample_records(tokenizer):
    """The batch's records, the mismatching one carrying expected ids that differ at one token."""
    batch, rows = sample_batch(tokenizer)
    records = trajectory_records(batch, rows, tokenizer, step=1)
    mismatch = records[-1]
    actual = mismatch["prompt_ids"] + mismatch["response_ids"]
    first = len(mismatch["prompt_ids"]) + 1
    mismatch["expected_ids"] = actual[:first] + [actual[first] + 1] + actual[first + 1:]
    return records, first


def test_records_carry_ids_text_mask_and_indices(tokenizer):
    """A record holds what `agentloop view` shows: ids with their decoded text, mask, log-probs,
    reward, trajectory/segment indices. Debug: trajectory_records in viewer.py."""
    batch, rows = sample_batch(tokenizer)
    records = trajectory_records(batch, rows, tokenizer, step=7)
    assert len(records) == len(batch) == 5
    first = records[0]
    assert first["step"] == 7
    assert first["trajectory_index"] == 0
    assert first["reward"] == 1.0
    assert len(first["response_tokens"]) == len(first["response_ids"]) == len(first["response_mask"])
    assert "".join(first["response_tokens"]) == tokenizer.decode(first["response_ids"])
    assert [(r["trajectory_index"], r["segment_index"]) for r in records] == [(0, 0), (1, 0), (1, 1), (2, 0), (3, 0)]
    assert records[3]["failed"]
    assert records[3]["response_ids"] == []
    json.dumps(records)  # JSON-ready


def test_step_hook_keeps_k_trajectories_and_every_failed_one(tokenizer, tmp_path):
    """`trainer.log_trajectories_per_step=k` writes every segment of the first k trajectories and
    of every failed one. Debug: sample_rows."""
    batch, rows = sample_batch(tokenizer)
    assert sample_rows(batch, 0) == [3]  # the failed trajectory only
    assert sample_rows(batch, 2) == [0, 1, 2, 3]  # trajectory 1's two segments included
    path = write_step_trajectories(tmp_path, 4, batch, rows, tokenizer, 1, advantages=np.arange(5.0))
    assert path == tmp_path / "trajectories" / "step_4.jsonl"
    records = load_records(tmp_path)  # the run folder
    assert [r["trajectory_index"] for r in records] == [0, 2]
    assert [r["advantage"] for r in records] == [0.0, 3.0]
    assert {r["step"] for r in records} == {4}


def test_grouping_and_summary(tokenizer):
    """Segments of one trajectory form one list entry with its reward, tool calls, length."""
    records, _ = sample_records(tokenizer)
    trajectories = group_trajectories(records)
    assert [len(t) for t in trajectories] == [1, 2, 1, 1]
    s = summarize(trajectories[1])
    assert s["segments"] == 2
    assert s["tools"] == 1
    assert s["group"] == "train-1-0"
    assert s["sample"] == 1
    assert s["length"] == len(records[1]["response_ids"]) + len(records[2]["response_ids"])
    assert summarize(trajectories[2])["failed"]
    assert summarize(trajectories[3])["verdict"] == "mismatch"


def test_html_is_self_contained_and_counts_match(tokenizer):
    """One page, no network: no http(s) reference, no external script/style/img; per trajectory one
    model-coloured token per mask-1 token, log-prob on each, one list row each. Debug: render_html."""
    records, first = sample_records(tokenizer)
    page = render_html(records)
    assert not re.search(r"https?://", page)
    assert not re.search(r"<(script|link|img)[^>]+(src|href)=", page)
    assert page.count('class="traj-row') == 4
    for index, segments in enumerate(group_trajectories(records)):
        section = page.split(f'id="traj-{index}"')[1].split("</section>")[0]
        assert section.count('class="tok gen"') == sum(sum(s["response_mask"]) for s in segments)
        assert section.count("data-lp=") == section.count('class="tok gen"')
        assert section.count('class="segment"') == len(segments)
    assert "tool call: <b>calculator</b>" in page
    assert "TimeoutError: the tool hung" in page
    assert f'class="mismatch" data-first="{first}"' in page


def test_view_cli_writes_the_page_and_prints_its_path(tokenizer, tmp_path, capsys):
    """`agentloop view FILE --out X` writes X and prints it; a folder without trajectories is an
    error that says what to pass."""
    from agentloop_trainer.cli import main
    from agentloop_trainer.view import write_jsonl

    records, _ = sample_records(tokenizer)
    src = write_jsonl(records, tmp_path / "r.jsonl")
    out = tmp_path / "page" / "v.html"
    assert main(["view", str(src), "--out", str(out)]) == 0
    assert capsys.readouterr().out.strip() == str(out.resolve())
    assert out.read_text().startswith("<!DOCTYPE html>")
    assert main(["view", str(src)]) == 0
    assert (tmp_path / "r.html").exists()
    (tmp_path / "empty").mkdir()
    assert main(["view", str(tmp_path / "empty")]) == 2
    assert "log_trajectories_per_step" in capsys.readouterr().err


def test_records_without_text_show_ids(tokenizer):
    """A record without decoded text (an older rollout file) still renders, showing ids."""
    records, _ = sample_records(tokenizer)
    for r in records:
        r.pop("prompt_tokens"), r.pop("response_tokens")
    page = render_html(records[:1])
    assert f"[{records[0]['response_ids'][0]}]" in page


@pytest.mark.parametrize("bad", ["{not json"])
def test_bad_jsonl_names_the_line(tmp_path, bad):
    path = tmp_path / "x.jsonl"
    path.write_text('{"reward": 1}\n' + bad + "\n")
    with pytest.raises(ValueError, match=r"x.jsonl:2"):
        load_records(path)


def test_every_run_logs_trajectories_that_view_renders(random_model_path, tmp_path, capsys):
    """`agentloop train` writes trajectories/step_<N>.jsonl each step (log_trajectories_per_step
    trajectories, in the rollout format with decoded text) and `agentloop view <run>` renders
    them. Debug: the hook at the end of PolicyGradientTrainer.train_step."""
    from agentloop_trainer.cli import main

    assert main([
        "train", f"model.path={random_model_path}", "data.train_size=16", "data.val_size=2",
        "data.train_batch_size=2", "actor_rollout_ref.rollout.n=2", "data.max_response_length=24",
        "actor_rollout_ref.rollout.multi_turn.max_tokens_per_turn=8", "trainer.total_steps=2",
        "trainer.test_freq=0", "trainer.val_before_train=false", "trainer.save_freq=0",
        "trainer.progress_bar=false", "trainer.log_trajectories_per_step=3", f"trainer.output_dir={tmp_path}",
        "trainer.experiment_name=view",
    ]) == 0
    run = tmp_path / "view"
    for step in (1, 2):
        records = [json.loads(line) for line in (run / "trajectories" / f"step_{step}.jsonl").read_text().splitlines()]
        assert sorted({r["trajectory_index"] for r in records}) == [0, 1, 2]
        for r in records:
            assert r["step"] == step
            assert len(r["response_tokens"]) == len(r["response_ids"]) == len(r["response_mask"])
            assert {"reward", "metrics", "rollout_log_probs", "segment_index", "advantage"} <= set(r)
    capsys.readouterr()
    assert main(["view", str(run)]) == 0
    assert capsys.readouterr().out.strip() == str((run / "view.html").resolve())
    assert (run / "view.html").read_text().count('class="traj-row') == 6
