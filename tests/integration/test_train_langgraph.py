"""`agentloop train` with rows whose agent_name is react_agent: the trainer runs a LangGraph
graph through the registry (it never imports the LangGraph package), with the tool YAML and the
loop's own section from the config."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("agentloop_langgraph", reason="needs agentloop-langgraph (nox -s integration)")
pytest.importorskip("agentloop_trainer", reason="needs agentloop-trainer (nox -s integration)")

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "langgraph_calculator"


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    from agentloop_trainer.data import write_parquet_rows
    from agentloop_trainer.task import dataset_row, make_problems

    out = tmp_path_factory.mktemp("data")
    problems = make_problems(6, seed=1)
    for split, part in (("train", problems[:4]), ("test", problems[4:])):
        write_parquet_rows([{**dataset_row(p, split), "agent_name": "react_agent"} for p in part], out / f"{split}.parquet")
    return out


def _overrides(data: Path, model_path: Path, out: Path, *extra: str) -> list[str]:
    return [
        f"model.path={model_path}", f"data.train_files={data / 'train.parquet'}", f"data.val_files={data / 'test.parquet'}",
        f"actor_rollout_ref.rollout.multi_turn.tool_config_path={EXAMPLE / 'tools.yaml'}",
        "data.train_batch_size=2", "actor_rollout_ref.rollout.n=2", "data.max_response_length=40",
        "actor_rollout_ref.rollout.multi_turn.max_tokens_per_turn=12", "trainer.total_steps=2", "trainer.test_freq=0",
        "trainer.save_freq=0", "trainer.progress_bar=false", f"trainer.output_dir={out}", "trainer.experiment_name=lg",
        *extra,
    ]


def test_react_agent_rows_train_two_steps(data, model_path, tmp_path):
    from agentloop_trainer.cli import main

    argv = ["train", "--config", str(EXAMPLE / "config.yaml"), *_overrides(data, model_path, tmp_path)]
    assert main(argv) == 0
    steps = [json.loads(line) for line in (tmp_path / "lg" / "metrics.jsonl").read_text().splitlines()]
    train = [s for s in steps if "actor/pg_loss" in s]
    assert [s["step"] for s in train] == [1, 2]
    assert all(s["rollout/num_failed"] == 0 for s in train)


def test_rollout_runs_the_langgraph_loop_with_its_section(data, model_path, tmp_path):
    from agentloop_trainer.cli import write_rollouts
    from agentloop_trainer.config import load_config

    cfg = load_config(_overrides(data, model_path, tmp_path), EXAMPLE / "config.yaml")
    out = write_rollouts(cfg, model_path, tmp_path / "r.jsonl", num_prompts=2)
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert {r["metrics"]["agent_name"] for r in records} == {"react_agent"}
    assert all(not r["failed"] and len(r["response_ids"]) == len(r["response_mask"]) > 0 for r in records)


def test_a_typo_in_the_loops_section_is_an_error(data, model_path, tmp_path):
    from agentloop_trainer.cli import write_rollouts
    from agentloop_trainer.config import load_config

    cfg = load_config(_overrides(data, model_path, tmp_path,
                                 "actor_rollout_ref.rollout.agent.loops.react_agent.recursion_limt=5"),
                      EXAMPLE / "config.yaml")
    with pytest.raises(ValueError, match="recursion_limt.*recursion_limit"):
        write_rollouts(cfg, model_path, tmp_path / "r.jsonl", num_prompts=1)
