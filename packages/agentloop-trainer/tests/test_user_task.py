"""`agentloop train` on a task the user brings: their tool YAML (a native tool) and function
tool file, their reward function, and their parquet, with no agentloop code changed."""

from __future__ import annotations

import json
import textwrap

import pytest

from agentloop_trainer.cli import main
from agentloop_trainer.data import write_parquet_rows

NATIVE_TOOL = textwrap.dedent('''
    """A user's native tool: counts a letter in a word; its reward comes from the row."""
    import json, os
    from agentloop_tools.base import BaseTool
    from agentloop_tools.schema import ToolResponse

    class LetterCountTool(BaseTool):
        def default_tool_schema(self):
            return {"type": "function", "function": {
                "name": "count_letters", "description": "Count a letter in a word.",
                "parameters": {"type": "object", "properties": {
                    "word": {"type": "string"}, "letter": {"type": "string"}},
                    "required": ["word", "letter"]}}}

        async def execute(self, instance_id, parameters, **kwargs):
            n = str(parameters["word"]).count(str(parameters["letter"]))
            return ToolResponse(text=str(n)), 0.0, {"counted": 1}

        async def calc_reward(self, instance_id, **kwargs):
            # The row's calc_reward_kwargs arrive here; write them down so the test can see them.
            with open(os.environ["USER_TASK_LOG"], "a") as fh:
                fh.write(json.dumps({"state": self.state(instance_id), "calc_reward_kwargs": kwargs}) + "\\n")
            return float(kwargs.get("bonus", 0.0))
''')

FUNCTION_TOOLS = textwrap.dedent('''
    from agentloop_tools import function_tool

    @function_tool
    def shout(text: str) -> str:
        """Upper-case a text.

        Args:
            text: What to shout.
        """
        return text.upper()
''')

REWARD = textwrap.dedent('''
    async def compute_score(data_source, solution_str, ground_truth, extra_info=None, scale=1.0):
        assert data_source == "user/letters", data_source
        hit = str(ground_truth) in solution_str
        return {"score": scale * float(hit), "chars": float(len(solution_str))}
''')


@pytest.fixture
def user_task(tmp_path, monkeypatch):
    """A user's folder: tools.yaml + letter_tools.py (native), functions.py, reward.py, parquet."""
    folder = tmp_path / "my_task"
    folder.mkdir()
    (folder / "letter_tools.py").write_text(NATIVE_TOOL)
    (folder / "functions.py").write_text(FUNCTION_TOOLS)
    (folder / "reward.py").write_text(REWARD)
    (folder / "tools.yaml").write_text(textwrap.dedent('''
        tools:
          - class_name: letter_tools.LetterCountTool
            config: {type: native, timeout_s: 5}
    '''))
    rows = []
    for i, word in enumerate(["banana", "cherry", "apple", "kiwi", "mango", "papaya"]):
        rows.append({
            "data_source": "user/letters",
            "agent_name": "tool_agent",
            # OpenAI's list-of-parts content form, as many datasets store it.
            "prompt": [{"role": "user", "content": [{"type": "text", "text": "How many a's in "},
                                                    {"type": "text", "text": f"{word}?"}]}],
            "reward_model": {"style": "rule", "ground_truth": str(word.count("a"))},
            "extra_info": {"index": i, "tools_kwargs": {"count_letters": {
                "create_kwargs": {"word": word}, "calc_reward_kwargs": {"bonus": 0.25}}}},
        })
    write_parquet_rows(rows[:4], folder / "train.parquet")
    write_parquet_rows(rows[4:], folder / "val.parquet")
    monkeypatch.syspath_prepend(str(folder))
    monkeypatch.setenv("USER_TASK_LOG", str(folder / "calls.jsonl"))
    return folder


def _overrides(folder, model_path, out, *extra):
    return [
        f"model.path={model_path}", f"data.train_files={folder / 'train.parquet'}",
        f"data.val_files={folder / 'val.parquet'}",
        f"actor_rollout_ref.rollout.multi_turn.tool_config_path={folder / 'tools.yaml'}",
        f"actor_rollout_ref.rollout.multi_turn.function_tool_path={folder / 'functions.py'}",
        f"custom_reward_function.path={folder / 'reward.py'}", "+custom_reward_function.reward_kwargs.scale=2.0",
        "reward.source=sum", "data.train_batch_size=2", "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.rollout.multi_turn.max_tokens_per_turn=8", "data.max_response_length=24",
        "data.max_prompt_length=400", "trainer.total_steps=2", "trainer.test_freq=0", "trainer.save_freq=0",
        "trainer.progress_bar=false", f"trainer.output_dir={out}", "trainer.experiment_name=user", *extra,
    ]


@pytest.mark.slow
def test_train_runs_the_users_tools_reward_and_data(user_task, random_model_path, tmp_path, capsys):
    assert main(["train", *_overrides(user_task, random_model_path, tmp_path / "out")]) == 0
    run = tmp_path / "out" / "user"
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    train_steps = [s for s in steps if "actor/pg_loss" in s]
    assert [s["step"] for s in train_steps] == [1, 2]
    for s in train_steps:
        assert s["rollout/num_failed"] == 0
        # The user's function scored every sample (its extra number is a metric too), and the
        # native tool's calc_reward (0.25 from the row's calc_reward_kwargs) was added to it.
        assert "agent_loop/reward/chars/mean" in s
        assert "agent_loop/reward/function/mean" in s
        assert s["reward/mean"] == pytest.approx(s["agent_loop/reward/function/mean"] + 0.25, abs=1e-5)
    calls = [json.loads(line) for line in (user_task / "calls.jsonl").read_text().splitlines()]
    # 2 steps x 2 prompts x 2 samples, + 2 held-out prompts evaluated before and after.
    assert len(calls) == 8 + 4
    assert all(c["calc_reward_kwargs"] == {"bonus": 0.25} for c in calls)
    assert {c["state"]["word"] for c in calls} >= {"banana", "cherry", "apple", "kiwi"}
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 2
    assert summary["held_out_size"] == 2


def test_rollout_renders_both_tools_and_the_text_parts(user_task, random_model_path, tmp_path):
    from agentloop_trainer.cli import write_rollouts
    from agentloop_trainer.config import load_config

    cfg = load_config(_overrides(user_task, random_model_path, tmp_path / "out"))
    out = write_rollouts(cfg, random_model_path, tmp_path / "r.jsonl", num_prompts=2)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(random_model_path)
    record = json.loads(out.read_text().splitlines()[0])
    prompt = tok.decode(record["prompt_ids"])
    assert "count_letters" in prompt
    assert "shout" in prompt
    assert "How many a's in mango?" in prompt  # text parts joined in order
    assert record["data_source"] == "user/letters"


def test_a_reward_function_that_returns_junk_fails_the_sample_with_its_name(user_task, random_model_path, tmp_path):
    (user_task / "reward.py").write_text("def compute_score(data_source, solution_str, ground_truth, extra_info, "
                                         "scale=1):\n    return 'yes'\n")
    from agentloop_trainer.cli import write_rollouts
    from agentloop_trainer.config import load_config

    cfg = load_config(_overrides(user_task, random_model_path, tmp_path / "out"))
    out = write_rollouts(cfg, random_model_path, tmp_path / "r.jsonl", num_prompts=1)
    record = json.loads(out.read_text().splitlines()[0])
    assert record["failed"]
    assert "reward.py:compute_score returned 'yes'" in record["metrics"]["error"]


def test_a_reward_function_that_cannot_take_the_reward_kwargs_fails_before_any_rollout(user_task, random_model_path,
                                                                                        tmp_path):
    (user_task / "reward.py").write_text("def compute_score(data_source, solution_str, ground_truth, extra_info):\n"
                                         "    return 1.0\n")
    with pytest.raises(ValueError, match=r"compute_score must accept .*reward_kwargs \['scale'\]"):
        main(["train", *_overrides(user_task, random_model_path, tmp_path / "out")])


INTERACTION = textwrap.dedent('''
    """A user's simulated user: the built-in GSM8K checker, recording what each trajectory got."""
    import json, os
    from agentloop_tools.interaction import Gsm8kInteraction

    class RecordingChecker(Gsm8kInteraction):
        async def start(self, instance_id=None, **kwargs):
            with open(os.environ["USER_TASK_LOG"], "a") as fh:
                fh.write(json.dumps({"interaction_kwargs": kwargs, "config": self.config}) + "\\n")
            return await super().start(instance_id, **kwargs)
''')


@pytest.mark.slow
def test_train_with_an_interaction_from_its_yaml(tmp_path, random_model_path, monkeypatch):
    """A verl-style interaction YAML (a simulated user) and each row's interaction_kwargs reach
    the loop through `agentloop train`; with reward.source=loop the reward is the loop's own."""
    folder = tmp_path / "chat_task"
    folder.mkdir()
    (folder / "checker.py").write_text(INTERACTION)
    (folder / "interaction.yaml").write_text(textwrap.dedent('''
        interaction:
          - name: checker
            class_name: checker.RecordingChecker
            config: {retry_message: "Try again."}
    '''))
    monkeypatch.syspath_prepend(str(folder))
    monkeypatch.setenv("USER_TASK_LOG", str(folder / "calls.jsonl"))
    rows = [{"data_source": "user/chat", "prompt": [{"role": "user", "content": f"What is {i} + {i}?"}],
             "reward_model": {"ground_truth": str(2 * i)},
             "extra_info": {"index": i, "interaction_kwargs": {"name": "checker", "ground_truth": str(2 * i)}}}
            for i in range(6)]
    write_parquet_rows(rows[:4], folder / "train.parquet")
    write_parquet_rows(rows[4:], folder / "val.parquet")
    out = tmp_path / "out"
    assert main([
        "train", f"model.path={random_model_path}", f"data.train_files={folder / 'train.parquet'}",
        f"data.val_files={folder / 'val.parquet'}", "reward.source=loop",
        f"actor_rollout_ref.rollout.multi_turn.interaction_config_path={folder / 'interaction.yaml'}",
        "actor_rollout_ref.rollout.multi_turn.max_user_turns=2", "data.train_batch_size=2",
        "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.rollout.multi_turn.max_tokens_per_turn=6",
        "data.max_response_length=60", "trainer.total_steps=2", "trainer.test_freq=0", "trainer.save_freq=0",
        "trainer.progress_bar=false", f"trainer.output_dir={out}", "trainer.experiment_name=chat",
    ]) == 0
    steps = [json.loads(line) for line in (out / "chat" / "metrics.jsonl").read_text().splitlines()]
    train = [s for s in steps if "actor/pg_loss" in s]
    assert [s["step"] for s in train] == [1, 2]
    assert all(s["rollout/num_failed"] == 0 for s in train)
    calls = [json.loads(line) for line in (folder / "calls.jsonl").read_text().splitlines()]
    assert len(calls) == 2 * 2 * 2 + 2 * 2  # every trajectory, held-out ones before and after included
    assert all(c["config"]["retry_message"] == "Try again." for c in calls)
    assert {c["interaction_kwargs"]["ground_truth"] for c in calls} == {str(2 * i) for i in range(6)}
    assert all(c["interaction_kwargs"]["name"] == "checker" for c in calls)
