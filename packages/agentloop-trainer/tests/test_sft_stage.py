"""The general SFT stage: data checks, ids and mask equal to a tool_agent rollout's, training
through ``agentloop sft`` (loss falls, loadable folder, resume, LoRA + bf16), and the stage in
front of GRPO in ``agentloop train``."""

from __future__ import annotations

import asyncio
import json

import pytest

from agentloop_trainer.stages.sft import SFTDataError, SFTTokenizer, read_sft_files, write_sft_rows
from agentloop_trainer.task import calculator_rows


def _jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


GOOD = calculator_rows(1, seed=3)[0]


def _with(messages=None, **extra):
    row = {"messages": messages if messages is not None else GOOD["messages"], "tools": GOOD["tools"]}
    row.update(extra)
    return row


def _call(args):
    return {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {
        "name": "calculator", "arguments": args}}]}


SYS, USER = GOOD["messages"][0], GOOD["messages"][1]
MALFORMED = [
    (_with([SYS, USER]), "no assistant turn"),
    (_with([SYS, {"role": "bot", "content": "hi"}, {"role": "assistant", "content": "x"}]), "unknown role 'bot'"),
    (_with([SYS, USER, _call("{expression: 1}")]), "arguments are not parseable JSON"),
    (_with([SYS, USER, _call("[1, 2]")]), "arguments must be a JSON object"),
    (_with([SYS, USER, {"role": "assistant", "content": "", "tool_calls": [{"function": {"arguments": "{}"}}]}]),
     "has no function name"),
    (_with([SYS, USER, {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "search", "arguments": {}}}]}]), "not in the row's tools"),
    (_with([SYS, USER, {"role": "assistant", "content": "a"}, {"role": "tool", "content": "1"}]), "never trained"),
    (_with([SYS, {"role": "tool", "content": "1"}, {"role": "assistant", "content": "a"}]),
     "does not follow an assistant turn"),
    (_with([SYS, USER, {"role": "assistant", "content": "a"}, {"role": "assistant", "content": "b"}]),
     "both assistant turns"),
    (_with([{"role": "assistant", "content": "a"}]), "starts with an assistant turn"),
    (_with([SYS, USER, {"role": "assistant", "content": {"x": 1}}]), "content must be a string"),
    (_with(tools="{not json"), "'tools' is a string but not JSON"),
    ({"prompt": []}, "'messages' must be a non-empty list"),
    ("{broken", "not JSON"),
]


@pytest.mark.parametrize(("row", "why"), MALFORMED, ids=[w for _, w in MALFORMED])
def test_a_malformed_row_is_named_by_number_with_its_fix(tmp_path, row, why):
    path = _jsonl(tmp_path / "d.jsonl", [GOOD, GOOD, row, GOOD])
    with pytest.raises(SFTDataError) as err:
        read_sft_files(path)
    message = str(err.value)
    assert "1 of 4 rows are malformed" in message, message
    assert "row 2:" in message, message
    assert why in message, message


def test_parquet_and_jsonl_read_back_the_same_conversations(tmp_path):
    rows = calculator_rows(5, seed=1)
    a = read_sft_files(write_sft_rows(rows, tmp_path / "d.parquet"))
    b = read_sft_files(write_sft_rows(rows, tmp_path / "d.jsonl"))
    assert [e.messages for e in a] == [e.messages for e in b]
    assert [e.tools for e in a] == [e.tools for e in b] == [rows[0]["tools"]] * 5
    # tool call arguments come back as objects, whatever the file stored
    assert a[0].messages[2]["tool_calls"][0]["function"]["arguments"] == {"expression": rows[0]["extra_info"]["expression"]}


def _replay(tokenizer, example):
    """Run the tool_agent loop on the example's prompt with a scripted engine that emits the
    SFT ids of each assistant turn; returns (SFT tokenization, loop output)."""
    from agentloop_core.testing import ScriptedServer
    from agentloop_tools.agent_loop import ToolAgentLoop
    from agentloop_trainer.task import calculator_tool

    tc = SFTTokenizer(tokenizer).tokenize(example.messages, example.tools, check=True)
    turns = tc.assistant_turns()
    loop = ToolAgentLoop(ScriptedServer(turns), tokenizer, {"tools": {"calculator": calculator_tool()},
                                                             "tool_reward": "none", "response_length": 512,
                                                             "sanity_check": "strict"})
    first = next(i for i, m in enumerate(example.messages) if m["role"] == "assistant")
    out = asyncio.run(loop.run({"max_tokens": 128}, raw_prompt=example.messages[:first]))
    return tc, turns, out


@pytest.mark.parametrize("answer_format", ["#### {answer}", "The answer is {answer}."])
def test_sft_ids_and_mask_equal_a_tool_agent_rollout_of_the_demonstration(tmp_path, tokenizer, answer_format):
    rows = calculator_rows(3, seed=11, answer_format=answer_format)
    for example in read_sft_files(write_sft_rows(rows, tmp_path / "d.parquet")):
        tc, turns, out = _replay(tokenizer, example)
        assert len(turns) == 2
        assert out.prompt_ids + out.response_ids == tc.input_ids
        assert out.response_mask == tc.loss_mask[len(out.prompt_ids):]
        assert sum(tc.loss_mask[: len(out.prompt_ids)]) == 0
        answer = example.messages[-1]["content"]
        assert tokenizer.decode(out.response_ids).endswith(answer + "<|im_end|>")
        # loss stops at each turn's end-of-turn token: the "\n" glue after it is not trained
        trained = tokenizer.decode([t for t, m in zip(tc.input_ids, tc.loss_mask, strict=True) if m])
        assert trained.count("<|im_end|>") == 2
        assert "<|im_end|>\n" not in trained


def test_a_two_call_conversation_replays_identically(tokenizer):
    from agentloop_trainer.stages.sft import parse_row

    row = calculator_rows(1, seed=4)[0]
    m = row["messages"]
    second = {"role": "assistant", "content": "Let me check.", "tool_calls": [{"id": "c2", "type": "function",
              "function": {"name": "calculator", "arguments": json.dumps({"expression": "2 * 3"})}}]}
    tool2 = {"role": "tool", "name": "calculator", "tool_call_id": "c2", "content": "6"}
    example = parse_row({"messages": [*m[:4], second, tool2, m[4]], "tools": row["tools"]})
    tc, turns, out = _replay(tokenizer, example)
    assert len(turns) == 3
    assert out.prompt_ids + out.response_ids == tc.input_ids
    assert out.response_mask == tc.loss_mask[len(out.prompt_ids):]


def test_a_template_that_drops_tool_calls_is_an_error_naming_the_fix(tokenizer):
    import copy

    from agentloop_trainer.stages.sft import parse_row

    plain = copy.copy(tokenizer)
    # ChatML that renders only content, like SmolLM2's own template.
    plain.chat_template = ("{%- for message in messages %}{{- '<|im_start|>' + message.role + '\\n' + message.content "
                           "+ '<|im_end|>\\n' }}{%- endfor %}{%- if add_generation_prompt %}"
                           "{{- '<|im_start|>assistant\\n' }}{%- endif %}")
    with pytest.raises(ValueError, match="does not render the tool_calls of message 2.*model.custom_chat_template"):
        SFTTokenizer(plain).tokenize(parse_row(GOOD).messages, parse_row(GOOD).tools)


def _sft_args(tmp_path, demos, name, *extra):
    return ["sft", f"sft.train_files={demos}", "sft.batch_size=4", "sft.lr=3e-3", "sft.warmup_steps=1",
            f"trainer.run_dir={tmp_path / name}", "trainer.progress_bar=false", *extra]


@pytest.fixture
def demos(tmp_path):
    return write_sft_rows(calculator_rows(16, seed=2), tmp_path / "demos.parquet")


def _losses(run):
    return [json.loads(line)["sft/loss"] for line in (run / "sft" / "metrics.jsonl").read_text().splitlines()]


def test_agentloop_sft_lowers_the_loss_and_writes_a_loadable_folder(tmp_path, demos, random_model_path, tokenizer):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from agentloop_trainer.cli import main
    from agentloop_trainer.stages.sft import sft_loss
    from agentloop_trainer.stages.sft.stage import sft_tokenizer

    val = write_sft_rows(calculator_rows(4, seed=9), tmp_path / "val.jsonl")
    assert main(_sft_args(tmp_path, demos, "run", f"model.path={random_model_path}", "sft.total_steps=8",
                          f"sft.val_files={val}")) == 0
    out = tmp_path / "run" / "sft"
    losses = _losses(tmp_path / "run")
    assert len(losses) == 8
    assert sum(losses[-2:]) / 2 < 0.8 * losses[0]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["sft_steps"] == 8
    assert summary["sft_val_loss"] is not None
    model = AutoModelForCausalLM.from_pretrained(str(out / "hf"))
    reloaded = AutoTokenizer.from_pretrained(str(out / "hf"))
    assert reloaded.chat_template == tokenizer.chat_template
    # the saved weights are the trained ones: their loss on the data is below the start's
    from agentloop_trainer.config import load_config

    ex = read_sft_files(demos)[:4]
    sft = sft_tokenizer(load_config([]), reloaded)
    batch = [sft.tokenize(e.messages, e.tools) for e in ex]
    start = AutoModelForCausalLM.from_pretrained(str(random_model_path))
    with torch.no_grad():
        assert float(sft_loss(model, batch)) < 0.8 * float(sft_loss(start, batch))
    # a finished stage is reused, not trained again
    assert main(_sft_args(tmp_path, demos, "run", f"model.path={random_model_path}", "sft.total_steps=8")) == 0
    assert len(_losses(tmp_path / "run")) == 8


def test_resume_continues_from_the_saved_step_with_the_same_losses(tmp_path, demos, random_model_path):
    import shutil

    from agentloop_trainer.cli import main

    args = _sft_args(tmp_path, demos, "run", f"model.path={random_model_path}", "sft.total_steps=6",
                     "sft.save_freq=3", "sft.micro_batch_size=2")
    assert main(args) == 0
    full = _losses(tmp_path / "run")
    out = tmp_path / "run" / "sft"
    records = (out / "metrics.jsonl").read_text().splitlines()
    assert (out / "checkpoints" / "step_3" / "optimizer.pt").exists()
    # a crash after the step-3 checkpoint: the result and later steps never landed
    shutil.rmtree(out / "hf")
    (out / "summary.json").unlink()
    assert main(args + ["--resume"]) == 0
    resumed = _losses(tmp_path / "run")
    assert len(resumed) == 6
    # steps 1-3 were not run again (their records, timings included, are the first run's)
    assert (out / "metrics.jsonl").read_text().splitlines()[:3] == records[:3]
    assert json.loads((out / "summary.json").read_text())["sft_resumed_from_step"] == 3
    assert resumed[3:] == pytest.approx(full[3:], rel=1e-6, abs=1e-7)
    assert (out / "hf" / "config.json").exists()


def test_agentloop_sft_reads_the_host_mmap_threshold_as_train_does(tmp_path, demos, random_model_path, monkeypatch):
    import agentloop_trainer.stages.memory as memory
    from agentloop_trainer.cli import main

    set_to: list[int] = []
    monkeypatch.setattr(memory, "map_large_blocks", lambda threshold: set_to.append(threshold) or True)
    assert main(_sft_args(tmp_path, demos, "run", f"model.path={random_model_path}", "sft.total_steps=1",
                          "trainer.host_mmap_threshold_mb=4")) == 0
    assert set_to == [4 << 20]


def test_resume_without_a_checkpoint_fails_fast(tmp_path, demos, capsys):
    from agentloop_trainer.cli import main

    assert main(_sft_args(tmp_path, demos, "none", "sft.total_steps=2", "--resume")) == 2
    assert "no checkpoint" in capsys.readouterr().err


def test_lora_and_bfloat16_write_merged_weights(tmp_path, demos, random_model_path):
    import torch
    from safetensors.torch import load_file

    from agentloop_trainer.cli import main

    assert main(_sft_args(tmp_path, demos, "lora", f"model.path={random_model_path}", "sft.total_steps=3",
                          "model.lora_rank=4", "model.dtype=bfloat16", "model.enable_gradient_checkpointing=true",
                          "sft.lr=1e-2")) == 0
    out = tmp_path / "lora" / "sft" / "hf"
    weights = load_file(str(out / "model.safetensors"))
    assert not any("lora" in k for k in weights), "the folder must hold merged weights, no adapters"
    base = load_file(str(random_model_path / "model.safetensors"))
    assert set(weights) == set(base)
    changed = [k for k in base if not torch.equal(base[k], weights[k])]
    assert any("q_proj" in k for k in changed), "LoRA's update was not merged into the weights"
    assert not any("embed_tokens" in k or "norm" in k for k in changed), "only adapted modules may change"
    losses = _losses(tmp_path / "lora")
    assert all(loss == loss for loss in losses)
    assert len(losses) == 3


def test_overlong_conversations_are_dropped_with_a_count_or_rejected(tmp_path, demos):
    from agentloop_trainer.cli import main

    assert main(_sft_args(tmp_path, demos, "short", "sft.total_steps=1", "sft.max_length=5")) == 2
    assert main(_sft_args(tmp_path, demos, "strict", "sft.total_steps=1", "sft.max_length=5",
                          "sft.filter_overlong=false")) == 2
    from agentloop_core.testing import load_tiny_tokenizer
    from agentloop_trainer.config import load_config
    from agentloop_trainer.stages.sft.stage import sft_tokenizer, tokenize_examples

    sft = sft_tokenizer(load_config([]), load_tiny_tokenizer())
    examples = read_sft_files(demos)
    lengths = sorted(len(sft.tokenize(e.messages, e.tools).input_ids) for e in examples)
    cut = lengths[len(lengths) // 2]
    kept, dropped = tokenize_examples(sft, examples, cut, True, "sft.train_files")
    assert dropped == sum(n > cut for n in lengths) > 0
    assert len(kept) == len(examples) - dropped
    with pytest.raises(ValueError, match=r"exceed sft.max_length=.*row \d+ \("):
        tokenize_examples(sft, examples, cut, False, "sft.train_files")


def test_agentloop_train_runs_sft_then_grpo_in_one_run_folder(tmp_path, demos, random_model_path):
    from agentloop_trainer.cli import run_train
    from agentloop_trainer.config import load_config

    cfg = load_config([
        f"model.path={random_model_path}", f"sft.train_files={demos}", "sft.total_steps=2", "sft.batch_size=4",
        "sft.eval_before=true", f"trainer.run_dir={tmp_path / 'run'}", "trainer.total_steps=1",
        "trainer.test_freq=0", "trainer.save_freq=0", "trainer.progress_bar=false", "data.train_size=8",
        "data.val_size=2", "data.train_batch_size=2", "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.rollout.multi_turn.max_tokens_per_turn=8", "data.max_response_length=24",
    ])
    run_dir, summary = run_train(cfg, log=lambda *_: None)
    assert summary["start_checkpoint"] == str(tmp_path / "run" / "sft" / "hf")
    assert summary["sft_steps"] == 2
    for key in ("eval_accuracy_before_sft", "eval_accuracy_after_sft", "eval_accuracy_after"):
        assert isinstance(summary[key], float), key
    assert json.loads((run_dir / "summary.json").read_text())["sft_steps"] == 2
    assert (run_dir / "sft" / "metrics.jsonl").exists()
    assert (run_dir / "metrics.jsonl").exists()


def test_the_evaluation_before_sft_hands_its_memory_back_before_sft_runs(tmp_path, demos, random_model_path,
                                                                       monkeypatch):
    """The evaluation's engine is closed before SFT, but glibc kept what it freed: on the
    real-model recipe SFT then ran at ~9.5 GB resident on top of it instead of ~5."""
    from types import SimpleNamespace

    import agentloop_trainer.stages.rollout_setup as rollout_setup
    import agentloop_trainer.stages.sft.stage as stage
    from agentloop_trainer.config import load_config

    calls: list[str] = []
    monkeypatch.setattr(rollout_setup, "evaluate_checkpoint",
                        lambda *_a: calls.append("eval") or SimpleNamespace(accuracy=0.5, n=2))
    monkeypatch.setattr(stage, "run_sft", lambda *_a: calls.append("sft") or (tmp_path / "hf", {}))
    monkeypatch.setattr(stage, "release_host_memory", lambda: calls.append("release"))
    cfg = load_config([f"model.path={random_model_path}", f"sft.train_files={demos}", "sft.eval_before=true"])
    stage.start_checkpoint(cfg, tmp_path / "run", log=lambda *_: None)
    assert calls == ["eval", "release", "sft", "release"]
