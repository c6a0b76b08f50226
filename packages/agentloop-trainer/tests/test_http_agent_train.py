"""``agentloop train`` trains an agent written with the ``openai`` client, unchanged: the
``http_agent`` loop runs it against a recording gateway session per trajectory."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("openai")
pytest.importorskip("fastapi")

AGENT = textwrap.dedent('''
    """A user's agent: two chat calls with the openai client, the second after a follow-up."""
    import openai

    def run(base_url, row):
        client = openai.OpenAI(base_url=base_url, api_key="unused")
        messages = list(row["raw_prompt"])
        first = client.chat.completions.create(model="policy", messages=messages, temperature=0.3)
        messages += [{"role": "assistant", "content": first.choices[0].message.content},
                     {"role": "user", "content": "Check it once more."}]
        second = client.chat.completions.create(model="policy", messages=messages)
        text = first.choices[0].message.content + second.choices[0].message.content
        return {"reward": float(len(text) % 2), "metrics": {"chars": len(text)}}
''')


README = Path(__file__).resolve().parents[3] / "README.md"


def _train(tmp_path, agent_source: str, *extra: str) -> list[dict]:
    from agentloop_trainer.cli import main
    from agentloop_trainer.data import write_parquet_rows

    agent = tmp_path / "my_agent.py"
    agent.write_text(agent_source)
    # The user's rows name no loop, so default_agent_loop picks http_agent.
    rows = [{"data_source": "user/chat", "prompt": [{"role": "user", "content": f"What is {i} + {i}?"}],
             "reward_model": {"ground_truth": str(2 * i)}, "extra_info": {"index": i}} for i in range(6)]
    write_parquet_rows(rows[:4], tmp_path / "train.parquet")
    write_parquet_rows(rows[4:], tmp_path / "val.parquet")
    out = tmp_path / "out"
    assert main([
        "train", f"data.train_files={tmp_path / 'train.parquet'}",
        f"data.val_files={tmp_path / 'val.parquet'}", "data.train_batch_size=2", "actor_rollout_ref.rollout.n=2", "reward.source=loop",
        "actor_rollout_ref.rollout.agent.default_agent_loop=http_agent",
        f"actor_rollout_ref.rollout.agent.loops.http_agent.agent={agent}:run",
        "actor_rollout_ref.rollout.multi_turn.max_tokens_per_turn=8", "data.max_response_length=60",
        "actor_rollout_ref.actor.lr=1e-2", "trainer.total_steps=2", "trainer.test_freq=0", "trainer.save_freq=0",
        "trainer.val_before_train=false", "trainer.progress_bar=false", f"trainer.output_dir={out}",
        "trainer.experiment_name=http", *extra,
    ]) == 0
    steps = [json.loads(line) for line in (out / "http" / "metrics.jsonl").read_text().splitlines()]
    return [s for s in steps if "actor/pg_loss" in s]


def test_the_readme_agent_trains(random_model_path, tmp_path):
    text = README.read_text()
    source = text[text.index("# my_agent.py"):]
    source = source[: source.index("```")]
    train_steps = _train(tmp_path, source, f"model.path={random_model_path}", "trainer.total_steps=1")
    assert len(train_steps) == 1
    assert train_steps[0]["rollout/num_failed"] == 0
    assert train_steps[0]["agent_loop/http_calls/mean"] == 1


def test_agentloop_train_runs_an_openai_client_agent(random_model_path, tmp_path):
    train_steps = _train(tmp_path, AGENT, f"model.path={random_model_path}")
    assert [s["step"] for s in train_steps] == [1, 2]
    for s in train_steps:
        assert s["rollout/num_failed"] == 0
        # Two calls per trajectory, each extending the last: one segment each.
        assert s["agent_loop/http_calls/mean"] == 2
        assert s["agent_loop/num_segments/max"] == 1
        assert "agent_loop/chars/mean" in s
