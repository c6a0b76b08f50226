"""Bad data and config: each is an error naming the row or key and the fix, raised before the
engine is asked for a single token."""

from __future__ import annotations

import copy
import json

import pytest
from fault_helpers import tool_engine

from agentloop_core import AgentLoopManager, RolloutBatch, SequenceTooLongError, UnknownAgentLoopError
from agentloop_core.testing import ScriptedServer
from agentloop_tools.builtin import calculator

PROMPT = [{"role": "user", "content": "2 + 3?"}]


def _rows(n: int = 4) -> list[dict]:
    return [{"raw_prompt": PROMPT, "agent_name": "single_turn_agent"} for _ in range(n)]


async def test_missing_agent_name_without_default_names_the_row_and_the_fix(tokenizer):
    engine = ScriptedServer()
    manager = AgentLoopManager(engine, tokenizer, {"sampling_params": {"max_tokens": 4}})
    rows = _rows()
    del rows[2]["agent_name"]
    with pytest.raises(ValueError, match=r"row 2 has no 'agent_name'.*default_agent_loop"):
        await manager.agenerate_sequences(rows)
    assert engine.calls == []


async def test_unknown_agent_name_lists_the_known_ones_before_any_compute(tokenizer):
    engine = ScriptedServer()
    manager = AgentLoopManager(engine, tokenizer, {"sampling_params": {"max_tokens": 4}}, num_workers=2)
    rows = _rows()
    rows[3]["agent_name"] = "tool_agnet"
    with pytest.raises(UnknownAgentLoopError) as info:
        await manager.agenerate_sequences(rows)
    assert "tool_agnet" in str(info.value)
    assert "single_turn_agent" in str(info.value)
    assert engine.calls == []


def test_unknown_sampling_parameter_names_the_config_key(tokenizer):
    engine = ScriptedServer()
    # Checked once, when the config becomes a RolloutConfig, before any batch.
    with pytest.raises(ValueError, match=r"config sampling_params.*max_token"):
        AgentLoopManager(engine, tokenizer, {"sampling_params": {"max_token": 4}})
    assert engine.calls == []


async def test_unknown_tool_in_a_rows_tools_kwargs_fails_that_sample_without_generating(tokenizer):
    engine = tool_engine(tokenizer, lambda rid, i: "no tools needed")
    cfg = {"default_agent_loop": "tool_agent", "tools": {"calculator": calculator}, "sampling_params": {"max_tokens": 20}}
    manager = AgentLoopManager(engine, tokenizer, cfg)
    rows = [{"raw_prompt": PROMPT, "request_id": f"r{i}"} for i in range(3)]
    rows[1]["tools_kwargs"] = {"calculater": {}}
    outputs = await manager.agenerate_outputs(rows)
    assert [o.failed for o in outputs] == [False, True, False]
    error = outputs[1].metrics["error"]
    assert "calculater" in error
    assert "configured tools: ['calculator']" in error
    assert outputs[1].metrics["sample_index"] == 1
    assert "r1" not in {c.request_id for c in engine.calls}  # no compute spent on the bad row


def test_unknown_tool_class_in_a_tool_config_names_the_entry(tmp_path):
    from agentloop_tools.load_tools import load_tools

    path = tmp_path / "tools.yaml"
    path.write_text("tools:\n  - class_name: agentloop_tools.builtin.NoSuchTool\n    config: {}\n")
    with pytest.raises(ValueError, match=r"tools\[0\].*NoSuchTool|NoSuchTool.*tools\[0\]"):
        load_tools(str(path))


async def test_overlong_prompt_is_an_error_naming_prompt_length(tokenizer):
    engine = ScriptedServer()
    cfg = {"default_agent_loop": "single_turn_agent", "prompt_length": 8, "sampling_params": {"max_tokens": 4}}
    manager = AgentLoopManager(engine, tokenizer, cfg)
    outputs = await manager.agenerate_outputs([{"raw_prompt": PROMPT}])
    assert outputs[0].failed
    assert "prompt_length is 8" in outputs[0].metrics["error"]
    assert engine.calls == []


def test_overlong_sequence_under_truncate_false_is_an_error_not_a_silent_cut(tokenizer):
    from agentloop_core import AgentLoopOutput

    out = AgentLoopOutput(prompt_ids=list(range(1, 20)), response_ids=[5] * 4, response_mask=[1] * 4)
    with pytest.raises(SequenceTooLongError, match="prompt_length"):
        RolloutBatch.from_outputs([out], prompt_length=8, response_length=8, pad_token_id=0, truncate=False)


async def test_chat_template_without_tool_support_is_refused_when_tools_are_configured(tokenizer):
    plain_tok = copy.deepcopy(tokenizer)
    # A template that renders messages but never looks at `tools`.
    plain_tok.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    engine = ScriptedServer()
    cfg = {"default_agent_loop": "tool_agent", "tools": {"calculator": calculator}}
    manager = AgentLoopManager(engine, plain_tok, cfg)
    outputs = await manager.agenerate_outputs([{"raw_prompt": PROMPT}])
    assert outputs[0].failed
    assert "chat template ignores tools=" in outputs[0].metrics["error"]
    assert "['calculator']" in outputs[0].metrics["error"]
    assert engine.calls == []
    # The tiny tokenizer's own template renders tools, so the same config is accepted there.
    ok = await AgentLoopManager(tool_engine(tokenizer, lambda r, i: "fine"), tokenizer, cfg).agenerate_outputs(
        [{"raw_prompt": PROMPT}])
    assert not ok[0].failed


def test_malformed_gsm8k_lines_are_reported_with_line_numbers(tmp_path):
    data = pytest.importorskip("agentloop_trainer.data", reason="agentloop-trainer is not installed")
    path = tmp_path / "train.jsonl"
    path.write_text("\n".join([
        json.dumps({"question": "1+1?", "answer": "two #### 2"}),
        "{not json",
        json.dumps({"question": "3?"}),
        json.dumps({"question": "4?", "answer": "no final line"}),
        json.dumps({"question": "5?", "answer": "#### five"}),
    ]) + "\n")
    rows, bad = data.read_gsm8k_jsonl(path, "train")
    assert len(rows) == 1
    assert [line for line, _ in bad] == [2, 3, 4, 5]
    assert "not JSON" in bad[0][1]
    assert "'question' and 'answer'" in bad[1][1]
    assert "####" in bad[2][1]


def test_parquet_without_required_columns_names_them(tmp_path):
    data = pytest.importorskip("agentloop_trainer.data", reason="agentloop-trainer is not installed")
    pytest.importorskip("pyarrow", reason="parquet needs pyarrow")
    path = data.write_parquet_rows([{"question": "1+1?", "agent_name": "tool_agent"}], tmp_path / "bad.parquet")
    with pytest.raises(ValueError, match=r"lacks columns \['prompt', 'reward_model'\]"):
        data.read_parquet_rows(path)
    with pytest.raises(FileNotFoundError, match="agentloop data gsm8k"):
        data.read_parquet_rows(tmp_path / "missing.parquet")
