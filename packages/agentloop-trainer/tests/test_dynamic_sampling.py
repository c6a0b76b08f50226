"""DAPO's over-long reward shaping and dynamic sampling: the penalty at its boundaries, the
group filter on hand-made reward tables (failed samples included), the sync step's draws with
trimming and the ``max_num_gen_batches`` limit, the buffer's discard, and the config checks.
Every expected number is worked out by hand in the test."""

from __future__ import annotations

import pytest

from agentloop_core import DEFAULT_RESPONSE_LENGTH
from agentloop_core.output import AgentLoopOutput
from agentloop_trainer.config import ConfigError, load_config
from agentloop_trainer.data.iterator import DataIterator
from agentloop_trainer.rollout.dynamic_sampling import (
    PENALTY_KEY,
    DynamicSampler,
    has_spread,
    overlong_penalty,
)
from agentloop_trainer.rollout.rollouts import attach_rewards, make_rows
from agentloop_trainer.stages.rollout_setup import dynamic_sampler


@pytest.mark.parametrize(("length", "expected"), [
    # max_response_length 100, buffer 20: no penalty up to 80 tokens, -1 from 100 on.
    (0, 0.0), (79, 0.0), (80, 0.0), (81, -0.05), (90, -0.5), (99, -0.95), (100, -1.0), (130, -1.0),
])
def test_overlong_penalty_at_its_boundaries(length, expected):
    assert overlong_penalty(length, 100, 20, 1.0) == pytest.approx(expected, abs=1e-12)


def test_overlong_penalty_scales_with_the_factor_and_a_one_token_buffer():
    assert overlong_penalty(90, 100, 20, 0.5) == pytest.approx(-0.25)  # half-way, half the factor
    assert overlong_penalty(99, 100, 1, 1.0) == 0.0  # 99 <= 100 - 1
    assert overlong_penalty(100, 100, 1, 2.0) == -2.0


@pytest.mark.parametrize(("values", "spread"), [
    ([1.0, 1.0, 1.0, 1.0], False),  # all solved: advantages all 0
    ([0.0, 0.0, 0.0, 0.0], False),
    ([0.0, 1.0, 0.0, 0.0], True),
    ([0.5, 0.5], False),
    ([None, 1.0, 1.0, 1.0], False),  # the failed sample is no measurement of 0
    ([None, 0.0, 1.0, 1.0], True),
    ([None, None, None, 1.0], False),  # one known value: no spread to learn from
    ([None, None], False),
    ([], False),
])
def test_a_group_is_kept_only_when_its_known_values_differ(values, spread):
    assert has_spread(values) is spread


def _out(t: int, reward: float | None, length: int = 3, *, failed: bool = False, acc: float | None = None):
    if failed:
        return AgentLoopOutput.failure(None, RuntimeError("engine died"), trajectory_index=t)
    out = AgentLoopOutput(prompt_ids=[5, 6], response_ids=[7] * length, response_mask=[1] * length,
                          reward_score=reward, trajectory_index=t)
    if acc is not None:
        out.metrics["reward/acc"] = acc
    return out


def _records(k: int) -> list[dict]:
    return [{"prompt": [{"role": "user", "content": f"q{i}"}], "data_source": "test", "extra_info": {"index": i}}
            for i in range(k)]


def _sampler(*overrides: str) -> DynamicSampler:
    return dynamic_sampler(load_config(["data.max_response_length=10", *overrides]))


def test_judge_shapes_rewards_then_filters_on_the_chosen_metric():
    """Three prompts of four samples, max_response_length 10, buffer 4 (the penalty starts
    after 6 tokens: 8 tokens is 2 of 4 over, -0.5; 10 tokens -1)."""
    rows = make_rows(_records(3), 4)
    table = [  # (reward, response length) per sample
        (1.0, 3), (1.0, 3), (1.0, 8), (1.0, 10),  # all solved; the long ones pay: 1, 1, 0.5, 0
        (0.0, 3), (1.0, 3), (0.0, 3), (1.0, 3),  # half solved, all short
        (None, 3), (1.0, 12), (1.0, 3), (1.0, 3),  # the first failed; 12 tokens counts as 10 (the row holds 10)
    ]
    shaping = ["reward_model.overlong_buffer.enable=true", "reward_model.overlong_buffer.len=4",
               "algorithm.filter_groups.enable=true"]

    def judged(metric: str):
        outputs = [_out(t, r, n, failed=r is None) for t, (r, n) in enumerate(table)]
        return _sampler(*shaping, f"algorithm.filter_groups.metric={metric}").judge(rows, outputs), outputs

    verdict, outputs = judged("seq_reward")
    assert [o.reward_score for o in outputs] == pytest.approx([1.0, 1.0, 0.5, 0.0, 0, 1, 0, 1, 0, 0.0, 1, 1])
    # The failed sample is not shaped (its reward is no measurement).
    assert [o.metrics.get(PENALTY_KEY) for o in outputs] == [0.0, 0.0, -0.5, -1.0, 0, 0, 0, 0, None, -1.0, 0, 0]
    # Shaped, the first group differs (1, 1, 0.5, 0) and the third too (failed, 0, 1, 1).
    assert verdict == {"train-0-0": True, "train-0-1": True, "train-0-2": True}
    # On the reward before shaping both are all-equal (1, 1, 1, 1 and failed, 1, 1, 1).
    assert judged("score")[0] == {"train-0-0": False, "train-0-1": True, "train-0-2": False}
    assert judged("acc")[0] == judged("score")[0], "no reward/acc from the function: acc is the unshaped reward"


def test_acc_reads_the_reward_functions_acc_when_it_returned_one():
    rows = make_rows(_records(1), 2)
    outputs = [_out(0, 0.3, acc=1.0), _out(1, 0.7, acc=1.0)]  # rewards differ, accuracies do not
    assert _sampler("algorithm.filter_groups.enable=true").judge(rows, outputs) == {"train-0-0": False}
    assert _sampler("algorithm.filter_groups.enable=true", "algorithm.filter_groups.metric=score").judge(
        rows, [_out(0, 0.3, acc=1.0), _out(1, 0.7, acc=1.0)]) == {"train-0-0": True}


class _ScriptedFleet:
    """Rolls out rows with rewards looked up by prompt index: a fake engine for the draw logic."""

    def __init__(self, rewards_by_prompt: dict[int, list[float]]) -> None:
        self.rewards, self.calls = rewards_by_prompt, []

    def generate_outputs(self, rows, step=None):
        self.calls.append([r["request_id"] for r in rows])
        return [_out(t, self.rewards[row["index"]][row["rollout_n"]]) for t, row in enumerate(rows)]

    def batch_from_outputs(self, outputs):
        from agentloop_core.batch import RolloutBatch

        batch = RolloutBatch.from_outputs(outputs, pad_token_id=0)
        attach_rewards(batch)
        return batch


# Six prompts of two samples, two a batch, in order: batch 1 keeps prompt 1 (prompt 0 is all
# solved), batch 2 keeps nothing, batch 3 keeps prompt 4 and trims prompt 5 (the step is full).
TABLE = {0: [1.0, 1.0], 1: [0.0, 1.0], 2: [0.0, 0.0], 3: [1.0, 1.0], 4: [1.0, 0.0], 5: [0.0, 1.0]}


def _sample(*overrides: str, log=print):
    fleet = _ScriptedFleet(TABLE)
    sampler = _sampler("algorithm.filter_groups.enable=true", "data.train_batch_size=2", *overrides)
    rows, batch, metrics = sampler.sample(fleet, DataIterator(_records(6), 2, seed=0, shuffle=False), 2, step=7,
                                          log=log)
    return fleet, rows, batch, metrics


def test_a_sync_step_draws_batches_until_it_is_full_and_trims_the_surplus():
    fleet, rows, batch, metrics = _sample()
    assert metrics == {"filter_groups/gen_batches": 3.0, "filter_groups/groups_generated": 6.0,
                       "filter_groups/groups_dropped": 3.0, "filter_groups/groups_trimmed": 1.0,
                       "filter_groups/groups_kept": 2.0, "filter_groups/groups_with_failed": 0.0,
                       "train/num_gen_batches": 3.0}
    # The first batch keeps a run's usual request ids; later ones are tagged by their draw.
    assert fleet.calls[0] == ["train-7-0-0", "train-7-0-1", "train-7-1-0", "train-7-1-1"]
    assert fleet.calls[2][0] == "train-gen3-7-0-0"
    assert [r["group_id"] for r in rows] == ["train-7-1", "train-7-1", "train-gen3-7-0", "train-gen3-7-0"]
    assert [r["index"] for r in rows] == [1, 1, 4, 4]
    assert batch.trajectory_index.tolist() == [0, 1, 2, 3]
    assert batch.rewards.tolist() == [0.0, 1.0, 1.0, 0.0]


def test_the_draw_limit_stops_the_run_or_trains_what_was_kept():
    with pytest.raises(RuntimeError, match=r"2 prompt batches .*max_num_gen_batches=2\) kept 1 groups .*3 of 4 "
                                           r"were all equal.*on_limit=train_kept"):
        _sample("algorithm.filter_groups.max_num_gen_batches=2")
    said: list[str] = []
    _, rows, batch, metrics = _sample("algorithm.filter_groups.max_num_gen_batches=2",
                                      "algorithm.filter_groups.on_limit=train_kept", log=said.append)
    assert [r["index"] for r in rows] == [1, 1]
    assert metrics["filter_groups/groups_kept"] == 1.0
    assert metrics["filter_groups/gen_batches"] == 2.0
    assert len(said) == 1
    assert said[0].startswith("WARNING: step 7: 2 prompt batches")
    # Enough batches: the limit is not hit.
    assert _sample("algorithm.filter_groups.max_num_gen_batches=3")[3]["filter_groups/groups_kept"] == 2.0


def test_train_kept_with_no_group_kept_says_there_is_nothing_to_train_on():
    fleet = _ScriptedFleet({i: [0.0, 0.0] for i in range(8)})
    sampler = _sampler("algorithm.filter_groups.enable=true", "data.train_batch_size=2",
                       "algorithm.filter_groups.max_num_gen_batches=2", "algorithm.filter_groups.on_limit=train_kept")
    with pytest.raises(RuntimeError, match=r"kept 0 groups .*nothing to train on \(even with on_limit=train_kept\)"):
        sampler.sample(fleet, DataIterator(_records(8), 2, seed=0, shuffle=False), 2, step=0, log=print)


def test_without_a_limit_a_long_draw_is_reported_every_ten_batches():
    """Prompts 0-19 all solved in every sample, 20-21 split: batch 11 is the first that keeps
    anything, so the step warns once, after batch 10."""
    fleet = _ScriptedFleet({**{i: [1.0, 1.0] for i in range(20)}, 20: [0.0, 1.0], 21: [1.0, 0.0]})
    said: list[str] = []
    sampler = _sampler("algorithm.filter_groups.enable=true", "data.train_batch_size=2")
    rows, _, metrics = sampler.sample(fleet, DataIterator(_records(22), 2, seed=0, shuffle=False), 2, step=0,
                                      log=said.append)
    assert metrics["filter_groups/gen_batches"] == 11.0
    assert [r["index"] for r in rows] == [20, 20, 21, 21]
    assert said == ["WARNING: step 0: 10 prompt batches so far kept 0 of the 2 groups a step trains; 20 of 20 had "
                    "the same acc in every sample. algorithm.filter_groups.max_num_gen_batches=0 draws until the "
                    "step is full: set a limit to stop"]


def test_failed_samples_count_as_no_measurement_in_the_draws():
    fleet = _ScriptedFleet(TABLE)
    real = fleet.generate_outputs

    def with_a_failure(rows, step=None):
        outputs = real(rows, step)
        if rows[0]["index"] == 0:  # prompt 0's first sample fails: (failed, 1) has no spread
            outputs[0] = _out(0, None, failed=True)
        return outputs

    fleet.generate_outputs = with_a_failure
    sampler = _sampler("algorithm.filter_groups.enable=true", "data.train_batch_size=2")
    _, _, metrics = sampler.sample(fleet, DataIterator(_records(6), 2, seed=0, shuffle=False), 2, step=0)
    assert metrics["filter_groups/groups_with_failed"] == 1.0
    assert metrics["filter_groups/groups_dropped"] == 3.0


def test_discarding_a_group_frees_its_room_in_the_staleness_buffer():
    from agentloop_trainer.stages.async_buffer import StalenessBuffer

    buffer = StalenessBuffer(batch_groups=1, max_staleness=0)
    group = buffer.start(0)
    assert not buffer.can_start(0), "room for one open group at max_staleness 0"
    buffer.discard(group)
    assert buffer.can_start(0)
    assert buffer.open_groups == []
    assert buffer.started == 1
    finished = buffer.start(0)
    buffer.finish(finished, "payload")
    with pytest.raises(ValueError, match="not an open, unfinished group"):
        buffer.discard(finished)


@pytest.mark.parametrize(("overrides", "message"), [
    (["algorithm.filter_groups.metric=pred"], r"filter_groups.metric must be one of \('acc', 'score'"),
    (["algorithm.filter_groups.max_num_gen_batches=-1"], "max_num_gen_batches must be >= 0"),
    (["algorithm.filter_groups.on_limit=skip"], "on_limit must be one of"),
    (["algorithm.filter_groups.enable=true", "algorithm.filter_groups.on_limit=train_kept", "trainer.mode=async"],
     "on_limit must be error with trainer.mode=async"),
    (["algorithm.filter_groups.enable=true", "actor_rollout_ref.rollout.n=1"], "rollout.n must be at least 2"),
    (["reward_model.overlong_buffer.enable=true"], r"overlong_buffer.len must be between 1 and "
                                                   rf"data.max_response_length - 1 \({DEFAULT_RESPONSE_LENGTH - 1}\).*got 0"),
    (["reward_model.overlong_buffer.enable=true", f"reward_model.overlong_buffer.len={DEFAULT_RESPONSE_LENGTH}"],
     f"got {DEFAULT_RESPONSE_LENGTH}"),
    (["reward_model.overlong_buffer.penalty_factor=-1"], "penalty_factor must be a finite number >= 0"),
])
def test_bad_dapo_settings_name_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(overrides)


def test_verl_dapo_keys_load():
    cfg = load_config(["algorithm.filter_groups.enable=true", "algorithm.filter_groups.metric=acc",
                       "algorithm.filter_groups.max_num_gen_batches=10", "reward_model.overlong_buffer.enable=true",
                       "reward_model.overlong_buffer.len=64", "reward_model.overlong_buffer.penalty_factor=1.0",
                       "reward_model.overlong_buffer.log=false", "reward_model.reward_manager=dapo"])
    assert cfg.algorithm.filter_groups.max_num_gen_batches == 10
    assert cfg.reward_model.overlong_buffer.len == 64
