"""`agentloop train` for two steps on examples/langgraph_summarising/config.yaml: the
summarising LangGraph agent named by import path, its trajectories split into segments, GRPO
on the segment rows. A random tiny model never calls the tool, so a nudge keeps each episode
going and every turn after the first starts a new segment."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("agentloop_trainer", reason="needs agentloop-trainer (the `agentloop train` command)")
torch = pytest.importorskip("torch", reason="the trainer needs torch")

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "langgraph_summarising"
TOOLS = EXAMPLE.parent / "langgraph_calculator" / "tools.yaml"


@pytest.fixture
def calculator_rows(tmp_path):
    """The calculator task as parquet rows for react_agent, as examples/langgraph_calculator/make_data.py
    writes them (a handful of rows)."""
    from agentloop_trainer.data import write_parquet_rows
    from agentloop_trainer.task import dataset_row, make_problems

    problems = make_problems(6, seed=1)
    for split, part in (("train", problems[:4]), ("test", problems[4:])):
        write_parquet_rows([{**dataset_row(p, split), "agent_name": "react_agent"} for p in part],
                           tmp_path / f"{split}.parquet")
    return tmp_path


@pytest.fixture
def one_thread():
    # The tiny model gains nothing from more threads; they only contend with other test processes.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_two_training_steps_of_the_summarising_agent(calculator_rows, model_path, tmp_path, one_thread):
    from agentloop_trainer.cli import main

    out = tmp_path / "out"
    assert main([
        "train", "--config", str(EXAMPLE / "config.yaml"), f"model.path={model_path}",
        f"data.train_files={calculator_rows / 'train.parquet'}", f"data.val_files={calculator_rows / 'test.parquet'}",
        f"actor_rollout_ref.rollout.multi_turn.tool_config_path={TOOLS}",
        "+actor_rollout_ref.rollout.agent.loops.react_agent.graph_factory_kwargs.nudge=Use the calculator.",
        "data.train_batch_size=2", "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.rollout.multi_turn.max_tokens_per_turn=8",
        "data.max_response_length=24", "trainer.total_steps=2", "trainer.test_freq=0", "trainer.save_freq=0",
        "trainer.progress_bar=false", f"trainer.output_dir={out}", "trainer.experiment_name=summarising",
    ]) == 0
    steps = [json.loads(line) for line in (out / "summarising" / "metrics.jsonl").read_text().splitlines()]
    train = [s for s in steps if "actor/pg_loss" in s]
    assert [s["step"] for s in train] == [1, 2]
    for s in train:
        assert s["rollout/num_failed"] == 0
        # max_assistant_turns=3, each turn after the first in a new context: three segments.
        assert s["agent_loop/num_segments/mean"] == 3.0
        assert s["rollout/num_samples"] == 4
        assert s.get("rollout/num_truncated", 0) == 0
        # The trainer's log-probs of each segment row, in the context it holds, are the engine's.
        assert s["rollout/logprob_abs_diff_max"] < 1e-3
