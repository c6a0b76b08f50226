"""``agentloop train`` with DAPO's dynamic sampling and over-long shaping on the tiny random
policy: three sync steps and two async ones complete, every trained group has a spread, and the
per-step counts of groups drawn, dropped and kept add up."""

from __future__ import annotations

import json
from collections import defaultdict

import pytest

from agentloop_trainer.cli import main

# Half the prompts (odd index) always score 0, so their groups are always dropped; the others
# score the parity of the response's length, which the samples of a group rarely all share.
REWARD = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    odd = extra_info["index"] % 2
    return {"score": 0.0 if odd else float(len(solution_str) % 2), "odd_prompt": float(odd)}
'''

FAST = ["data.train_size=32", "data.val_size=2", "data.train_batch_size=2", "actor_rollout_ref.rollout.n=4",
        "actor_rollout_ref.rollout.multi_turn.max_tokens_per_turn=12",
        "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=2", "data.max_response_length=40",
        "trainer.test_freq=0", "trainer.save_freq=0", "trainer.val_before_train=false", "trainer.progress_bar=false",
        "trainer.log_trajectories_per_step=16"]

DAPO = ["algorithm.filter_groups.enable=true", "algorithm.filter_groups.metric=score",
        "algorithm.filter_groups.max_num_gen_batches=8", "reward_model.overlong_buffer.enable=true",
        "reward_model.overlong_buffer.len=30", "reward_model.overlong_buffer.penalty_factor=0.5"]


def _train(tmp_path, model_path, *extra: str) -> tuple[list[dict], dict[int, list[dict]]]:
    reward = tmp_path / "reward.py"
    reward.write_text(REWARD)
    run = tmp_path / "run"
    argv = ["train", f"model.path={model_path}", f"trainer.run_dir={run}", f"custom_reward_function.path={reward}",
            *FAST, *DAPO, *extra]
    assert main(argv) == 0
    steps = [m for m in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "actor/pg_loss" in m]
    trajectories = {}
    for m in steps:
        lines = (run / "trajectories" / f"step_{m['step']}.jsonl").read_text().splitlines()
        trajectories[m["step"]] = [json.loads(line) for line in lines]
    return steps, trajectories


def _check_trained_groups(records: list[dict]) -> None:
    """Two whole groups of four, each with a spread of the unshaped reward (metric=score)."""
    groups: dict[str, list[dict]] = defaultdict(list)
    for r in records:
        groups[r["group_id"]].append(r)
    assert len(groups) == 2, sorted(groups)
    assert all(len(g) == 4 for g in groups.values()), sorted(groups)
    for g in groups.values():
        assert all(r["metrics"]["reward/odd_prompt"] == 0 for r in g), "odd prompts score 0 in every sample"
        unshaped = {r["reward"] - r["metrics"].get("reward/overlong_penalty", 0.0) for r in g if not r["failed"]}
        assert len({round(u, 6) for u in unshaped}) > 1, g


@pytest.mark.slow
def test_three_sync_steps_with_dynamic_sampling_and_overlong_shaping(tmp_path, random_model_path):
    steps, trajectories = _train(tmp_path, random_model_path, "trainer.total_steps=3")
    assert [m["step"] for m in steps] == [1, 2, 3]
    dropped = 0
    for m in steps:
        assert m["filter_groups/groups_kept"] == 2
        assert m["filter_groups/groups_generated"] == 2 * m["filter_groups/gen_batches"]
        assert m["filter_groups/groups_generated"] == (m["filter_groups/groups_kept"] + m["filter_groups/groups_dropped"]
                                                       + m["filter_groups/groups_trimmed"])
        assert m["rollout/groups_with_signal"] == 1.0
        assert m["rollout/num_samples"] == 8
        assert 0 <= m["reward/overlong_count"] <= 8
        assert -0.5 <= m["reward/overlong_penalty_mean"] <= 0
        dropped += m["filter_groups/groups_dropped"]
        _check_trained_groups(trajectories[m["step"]])
    assert dropped >= 1, "the odd prompts' groups are dropped"
    assert sum(m["reward/overlong_count"] for m in steps) >= 1, "12-token turns pass the 10 tokens before the buffer"
    penalized = [r for recs in trajectories.values() for r in recs if r["metrics"].get("reward/overlong_penalty", 0) < 0]
    for r in penalized:  # -min(1, (length - 10) / 30) * 0.5, length the response's tokens
        length = min(len(r["response_ids"]), 40)
        assert r["metrics"]["reward/overlong_penalty"] == pytest.approx(-min(1.0, (length - 10) / 30) * 0.5)


@pytest.mark.slow
def test_two_async_steps_drop_all_equal_groups_as_they_enter_the_buffer(tmp_path, random_model_path):
    steps, trajectories = _train(tmp_path, random_model_path, "trainer.total_steps=2", "trainer.mode=async")
    assert [m["step"] for m in steps] == [1, 2]
    for m in steps:
        assert m["staleness/max"] <= 1
        assert m["rollout/groups_with_signal"] == 1.0
        assert m["filter_groups/groups_generated"] == m["filter_groups/groups_kept"] + m["filter_groups/groups_dropped"]
        _check_trained_groups(trajectories[m["step"]])
    assert sum(m["filter_groups/groups_dropped"] for m in steps) >= 1
