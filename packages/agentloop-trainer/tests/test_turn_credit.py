"""Credit per turn (``algorithm.turn_credit``): turns read from the response mask, per-turn
rewards by the outcome rule, and each mode's advantages against numbers worked out by hand.

The group used throughout (``g``, gamma 1 unless said), three trajectories of unequal turns:

- A: 3 turns, no declared rewards, R = 1  -> r = [0, 0, 1],   G = [1, 1, 1]
- B: 1 turn,  no declared rewards, R = 0  -> r = [0],         G = [0]
- C: 2 turns, declares [-0.1, 0],  R = -0.1 -> r = [-0.1, 0], G = [-0.1, 0]

A and C see the same tokens before their second turn (an anchor state for ``step_group``).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from agentloop_core.batch import RolloutBatch
from agentloop_core.output import AgentLoopOutput
from agentloop_trainer.update import (
    CreditSettings,
    batch_trajectories,
    compute_advantages,
    credit_advantages,
    discounted_returns,
    leave_one_out_advantages,
    mask_runs,
    per_turn_advantages,
    token_advantages,
    trajectory_advantages,
    turn_rewards,
)

PROMPT = [1, 2, 3]


def _out(response, mask, reward, traj, *, prompt=PROMPT, seg=0, turn_rewards=None):
    extra = {} if turn_rewards is None else {"turn_rewards": turn_rewards}
    return AgentLoopOutput(list(prompt), list(response), list(mask), reward_score=reward, extra_fields=extra,
                           trajectory_index=traj, segment_index=seg)


def _group(*, split_a=False):
    """Rows of A, B, C (A in two segments when ``split_a``)."""
    if split_a:
        a = [_out([10, 11, 50, 20], [1, 1, 0, 1], 1.0, 0),
             _out([30], [1], 1.0, 0, prompt=[7, 8], seg=1)]
    else:
        a = [_out([10, 11, 50, 20, 51, 30], [1, 1, 0, 1, 0, 1], 1.0, 0)]
    b = _out([12], [1], 0.0, 1)
    c = _out([10, 11, 50, 21], [1, 1, 0, 1], -0.1, 2, turn_rewards=[-0.1, 0.0])
    return RolloutBatch.from_outputs([*a, b, c], pad_token_id=0)


def _per_turn(mode, estimator="dr_grpo", gamma=1.0, weight=1.0, batch=None):
    batch = batch or _group()
    trajs = batch_trajectories(batch, ["g"] * len(batch), observations=True)
    return per_turn_advantages(trajs, CreditSettings(mode, estimator, gamma, weight))


def _close(got, expected):
    """Per-turn advantages equal to 1e-6 (rewards travel as float32)."""
    assert [len(row) for row in got] == [len(row) for row in expected], (got, expected)
    for g, e in zip(got, expected, strict=True):
        assert g == pytest.approx(e, abs=1e-6), (got, expected)


def test_turns_are_runs_of_model_tokens():
    assert mask_runs([0, 1, 1, 0, 0, 1, 0, 1]) == [(1, 3), (5, 6), (7, 8)]
    assert mask_runs([0, 0]) == []
    trajs = batch_trajectories(_group(), ["g"] * 3)
    assert [len(t.turns) for t in trajs] == [3, 1, 2]
    assert [(s.start, s.end) for s in trajs[0].turns] == [(0, 2), (3, 4), (5, 6)]


def test_turns_count_on_across_segments():
    batch = _group(split_a=True)
    trajs = batch_trajectories(batch, ["g"] * len(batch), observations=True)
    a = trajs[0]
    assert [(s.row, s.start, s.end) for s in a.turns] == [(0, 0, 2), (0, 3, 4), (1, 0, 1)]
    assert a.rewards == (0.0, 0.0, 1.0)
    # the second segment's turn saw only that segment's prompt
    whole = batch_trajectories(_group(), ["g"] * 3, observations=True)[0]
    assert a.turns[1].observation == whole.turns[1].observation
    assert a.turns[2].observation != whole.turns[2].observation
    # same per-turn advantages as unsplit (A's 3rd turn is alone in its anchor group either way)
    for mode in ("discounted", "turn_group", "step_group"):
        _close(_per_turn(mode, batch=batch), _per_turn(mode))
    adv = credit_advantages(CreditSettings("turn_group", "dr_grpo"), batch, ["g"] * len(batch))
    torch.testing.assert_close(adv[0, :4], torch.tensor([1.05, 1.05, 0.0, 1.0]))
    torch.testing.assert_close(adv[1, :1], torch.tensor([1.05]))


def test_outcome_rule_puts_the_rest_of_the_reward_on_the_last_turn():
    assert turn_rewards(None, 3, 1.0) == [0.0, 0.0, 1.0]
    assert turn_rewards([], 2, 0.5) == [0.0, 0.5]
    # env_agent: R is already the sum of the step rewards, nothing is added
    assert turn_rewards([0.0, -0.1, 1.0], 3, 0.9) == pytest.approx([0.0, -0.1, 1.0])
    # a function's score on top of the loop's (reward.source=sum): the rest goes last
    assert turn_rewards([0.5, 0.0, 0.25], 3, 1.75) == pytest.approx([0.5, 0.0, 1.25])
    assert turn_rewards(None, 0, 0.0) == []
    with pytest.raises(ValueError, match=r"trajectory 7 declares 2 turn rewards .* holds 3 turns"):
        turn_rewards([1.0, 0.0], 3, 1.0, "trajectory 7")
    with pytest.raises(ValueError, match="list of finite numbers"):
        turn_rewards([float("nan")], 1, 0.0)


def test_a_loop_whose_turn_rewards_miss_a_turn_is_an_error():
    batch = RolloutBatch.from_outputs([_out([10, 50, 11], [1, 0, 1], 1.0, 0, turn_rewards=[1.0]),
                                       _out([12], [1], 0.0, 1)], pad_token_id=0)
    with pytest.raises(ValueError, match="trajectory 0 declares 1 turn rewards"):
        credit_advantages(CreditSettings("discounted"), batch, ["g", "g"])


def test_discounted_returns():
    assert discounted_returns([0.0, -0.1, 1.0], 0.5) == pytest.approx([0.2, 0.4, 1.0])
    assert discounted_returns([0.0, 0.0, 1.0], 1.0) == [1.0, 1.0, 1.0]


def test_discounted_mode_hand_values():
    # baseline of each trajectory: the mean episode return G_0 of the *other* two
    # A: 1 - (0 - 0.1)/2;  B: 0 - (1 - 0.1)/2;  C: G - (1 + 0)/2
    _close(_per_turn("discounted"), [[1.05, 1.05, 1.05], [-0.45], [-0.6, -0.5]])
    # gamma 0.5: G_A = [0.25, 0.5, 1], G_B = [0], G_C = [-0.1, 0]; E = (0.25, 0, -0.1)
    _close(_per_turn("discounted", gamma=0.5), [[0.3, 0.55, 1.05], [-0.075], [-0.225, -0.125]])


def test_turn_group_mode_hand_values_with_unequal_turn_counts():
    # turn 0: against the others' turn-0 returns; A's turn 1: only C reached it (G_C1 = 0);
    # A's turn 2: no one else did -> the others' episode returns (0, -0.1); C's turn 1: A's G_1 = 1
    _close(_per_turn("turn_group"), [[1.05, 1.0, 1.05], [-0.45], [-0.6, -1.0]])


def test_grpo_scale_is_the_std_of_the_values_compared():
    got = _per_turn("turn_group", estimator="grpo")
    # B's turn 0: 0 against (1, -0.1): -0.45 over stdev(0, 1, -0.1) = sqrt(0.37)
    assert got[1][0] == pytest.approx(-0.45 / (math.sqrt(0.37) + 1e-6))
    # C's turn 1: 0 against A's 1 alone: -1 over stdev(0, 1) = sqrt(0.5)
    assert got[2][1] == pytest.approx(-1.0 / (math.sqrt(0.5) + 1e-6))
    # all-equal returns give 0, never a difference over ~0
    same = RolloutBatch.from_outputs([_out([10], [1], 1.0, 0), _out([11], [1], 1.0, 1)], pad_token_id=0)
    trajs = batch_trajectories(same, ["g", "g"])
    assert per_turn_advantages(trajs, CreditSettings("turn_group", "grpo")) == [[0.0], [0.0]]


def test_step_group_mode_hand_values():
    # episode advantages (dr_grpo on R = 1, 0, -0.1; mean 0.3): 0.7, -0.3, -0.4
    # anchor at turn 0 (the prompt, shared by all): 1.05, -0.45, -0.6 (as discounted)
    # anchor at turn 1 (A and C saw [1 2 3 10 11 50]): A 1 - 0 = 1, C 0 - 1 = -1; A's turn 2 alone: 0
    _close(_per_turn("step_group"), [[1.75, 1.7, 0.7], [-0.75], [-1.0, -1.4]])
    _close(_per_turn("step_group", weight=0.5), [[1.225, 1.2, 0.7], [-0.525], [-0.7, -0.9]])


def test_leave_one_out_baselines_exclude_the_sample_itself():
    # one turn each, outcome-only: the per-turn modes are RLOO exactly (baseline: the mean of
    # the *others*; a naive group mean would give 1 - 0.5 = 0.5, shrunk by the sample's own share)
    rewards = [1.0, 0.0, 0.0, 1.0]
    batch = RolloutBatch.from_outputs([_out([10 + k], [1], r, k) for k, r in enumerate(rewards)], pad_token_id=0)
    trajs = batch_trajectories(batch, ["g"] * 4, observations=True)
    loo = leave_one_out_advantages(torch.tensor(rewards), ["g"] * 4).tolist()
    assert loo == pytest.approx([2 / 3, -2 / 3, -2 / 3, 2 / 3])
    for mode in ("discounted", "turn_group"):
        assert [row[0] for row in per_turn_advantages(trajs, CreditSettings(mode, "dr_grpo"))] == pytest.approx(loo)


def _naive_turn_normalised(trajs):
    """The biased construction verl RFC #7244 warns about: per turn index, each reward minus the
    mean reward at that index over every trajectory that reached it (its own included), summed
    over the turns the trajectory itself went on to take."""
    out = []
    for t in trajs:
        row = []
        for s in range(len(t.rewards)):
            total = 0.0
            for k in range(s, len(t.rewards)):
                at_k = [u.rewards[k] for u in trajs if len(u.rewards) > k]
                total += t.rewards[k] - sum(at_k) / len(at_k)
            row.append(total)
        out.append(row)
    return out


def test_per_turn_estimators_are_unbiased_by_exact_enumeration():
    """A policy that controls when to stop: P(continue) = P(good second turn) = p = sigmoid(theta).
    Stop: one turn, reward 0.3. Continue: 0.5 now, then 1 (good) or 0 (bad). J = 0.3 (1 - p) +
    p (0.5 + p), so dJ/dtheta = (0.2 + 2p) p (1 - p). The expected policy gradient
    (1/n) sum_i sum_t A_it dlog pi(a_it)/dtheta over every group of n = 3 (exact, all 27 groups)
    equals it for the leave-one-out modes; the naive per-turn normalisation does not."""
    import itertools

    p = 0.6
    # response tokens, mask, per-turn rewards, probability, dlog pi/dtheta per turn
    kinds = {"stop": ([20], [1], [0.3], 1 - p, [-p]),
             "good": ([21, 50, 22], [1, 0, 1], [0.5, 1.0], p * p, [1 - p, 1 - p]),
             "bad": ([21, 50, 23], [1, 0, 1], [0.5, 0.0], p * (1 - p), [1 - p, -p])}
    true = (0.2 + 2 * p) * p * (1 - p)

    def expected(advantages_of, n=3):
        total = 0.0
        for combo in itertools.product(kinds, repeat=n):
            outs = [_out(kinds[c][0], kinds[c][1], sum(kinds[c][2]), k, prompt=[1, 2], turn_rewards=kinds[c][2])
                    for k, c in enumerate(combo)]
            trajs = batch_trajectories(RolloutBatch.from_outputs(outs, pad_token_id=0), ["g"] * n, observations=True)
            adv = advantages_of(trajs)
            g = sum(a * d for k, c in enumerate(combo) for a, d in zip(adv[k], kinds[c][4], strict=True)) / n
            total += math.prod(kinds[c][3] for c in combo) * g
        return total

    def mode(name, estimator):
        return lambda trajs: per_turn_advantages(trajs, CreditSettings(name, estimator))

    assert expected(mode("discounted", "dr_grpo")) == pytest.approx(true, rel=1e-6)
    assert expected(mode("turn_group", "dr_grpo")) == pytest.approx(true, rel=1e-6)
    assert expected(mode("trajectory", "rloo")) == pytest.approx(true, rel=1e-6)
    # step_group = trajectory + w x step term; the step term acts only where the state is shared
    # (GiGPO), so it misses the second turn when both others stopped: P = (1-p)^2, and that
    # turn's share of the gradient is E[G_1 dlog pi_1] = p^2 (1 - p)
    assert expected(mode("step_group", "rloo")) == pytest.approx(true + (true - (1 - p) ** 2 * p * p * (1 - p)),
                                                                 rel=1e-6)
    naive = expected(_naive_turn_normalised)
    assert naive == pytest.approx(0.30095 * true, rel=1e-3)  # a third of the gradient: biased


def test_trajectory_mode_is_todays_advantages():
    batch = _group(split_a=True)
    groups = ["g"] * len(batch)
    for estimator in ("grpo", "dr_grpo", "rloo"):
        today = trajectory_advantages(estimator, torch.as_tensor(batch.rewards), groups,
                                      batch.trajectory_index.tolist())
        got = credit_advantages(CreditSettings("trajectory", estimator), batch, groups)
        assert got.shape == (len(batch),)
        assert torch.equal(got, today)
        # the table's trajectory mode, per token, is the same number on every model token
        trajs = batch_trajectories(batch, groups)
        tokens = token_advantages(tuple(batch.response_mask.shape), trajs,
                                  per_turn_advantages(trajs, CreditSettings("trajectory", estimator)))
        mask = torch.as_tensor(batch.response_mask).bool()
        torch.testing.assert_close(tokens[mask], today.unsqueeze(1).expand_as(tokens)[mask])
        assert (tokens[~mask] == 0).all()
    assert compute_advantages("grpo", torch.tensor([1.0, 0.0, -0.1]), ["g"] * 3).shape == (3,)


def test_per_token_advantages_follow_the_turns():
    batch = _group()
    adv = credit_advantages(CreditSettings("step_group", "dr_grpo"), batch, ["g"] * 3)
    assert adv.shape == batch.response_mask.shape
    torch.testing.assert_close(adv[0, :6], torch.tensor([1.75, 1.75, 0.0, 1.7, 0.0, 0.7]))
    torch.testing.assert_close(adv[2, :4], torch.tensor([-1.0, -1.0, 0.0, -1.4]))


def test_a_failed_sample_has_no_turns_but_counts_in_the_episode_baseline():
    ok = [_out([10], [1], 1.0, 0), _out([11], [1], 0.0, 1)]
    failed = AgentLoopOutput(list(PROMPT), [], [], reward_score=None, trajectory_index=2,
                             metrics={"failed": True, "error": "boom"})
    batch = RolloutBatch.from_outputs([*ok, failed], pad_token_id=0)
    assert bool(batch.failed[2])
    trajs = batch_trajectories(batch, ["g"] * 3)
    assert trajs[2].turns == ()
    # A: 1 - mean(0, 0); B: 0 - mean(1, 0)
    assert per_turn_advantages(trajs, CreditSettings("discounted", "dr_grpo")) == [[1.0], [-0.5], []]


def test_reward_function_per_turn_scores(tmp_path):
    import asyncio

    from agentloop_trainer.reward import RewardScorer, split_score, turn_rewards_of

    assert split_score([0.5, 0.25], "f") == (0.75, {})
    assert split_score({"turn_rewards": [1, 0], "acc": 1}, "f") == (1.0, {"acc": 1.0})
    assert split_score({"turn_rewards": [1, 0], "score": 3}, "f") == (3.0, {})
    assert turn_rewards_of({"score": 1.0}, "f") is None
    with pytest.raises(ValueError, match="give a list of numbers"):
        turn_rewards_of({"score": 1.0, "turn_rewards": 2}, "f")

    class Tok:
        def decode(self, ids, skip_special_tokens=True):
            return " ".join(map(str, ids))

    f = tmp_path / "r.py"
    f.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info):\n"
                 "    return {'score': 2.0, 'turn_rewards': [0.5, 0.5]}\n")
    row = {"data_source": "user/x", "reward_model": {"ground_truth": "x"}, "extra_info": {}}

    def score(source, path=str(f)):
        out = AgentLoopOutput([1], [7, 8, 9], [1, 0, 1], reward_score=0.3, extra_fields={"turn_rewards": [0.1, 0.2]})
        asyncio.run(RewardScorer(source, path=path)(out, row, Tok()))
        return out

    assert score("function").extra_fields["turn_rewards"] == [0.5, 0.5]  # the loop's are no part of R
    out = score("sum")
    assert out.reward_score == pytest.approx(2.3)
    assert out.extra_fields["turn_rewards"] == pytest.approx([0.6, 0.7])
    assert score("loop").extra_fields["turn_rewards"] == [0.1, 0.2]
    g = tmp_path / "plain.py"
    g.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info):\n    return 1.0\n")
    assert "turn_rewards" not in score("function", str(g)).extra_fields


def test_config_keys_and_validation():
    from agentloop_trainer.config import load_config
    from agentloop_trainer.config.errors import ConfigError

    cfg = load_config(["algorithm.turn_credit=step_group", "algorithm.turn_gamma=0.9",
                       "algorithm.step_group_weight=0.5"])
    assert CreditSettings.from_config(cfg.algorithm) == CreditSettings("step_group", "grpo", 0.9, 0.5)
    assert load_config([]).algorithm.turn_credit == "trajectory"
    with pytest.raises(ConfigError, match="algorithm.turn_gamma must be between 0 and 1"):
        load_config(["algorithm.turn_gamma=1.5"])
    with pytest.raises(ConfigError, match="algorithm.turn_credit must be one of"):
        load_config(["algorithm.turn_credit=per_turn"])
    with pytest.raises(ConfigError, match="rollout.n must be at least 2 with algorithm.turn_credit=step_group"):
        load_config(["algorithm.turn_credit=step_group", "actor_rollout_ref.rollout.n=1"])
    with pytest.raises(ConfigError, match="algorithm.step_group_weight"):
        load_config(["algorithm.step_group_weight=-1"])


def test_two_step_train_on_number_guess_with_per_turn_credit(random_model_path, tmp_path, monkeypatch):
    """``agentloop train`` with ``algorithm.turn_credit=discounted`` on the multi-step number_guess
    environment: the loss stays finite and the turns of a row get different advantages (later
    turns have fewer -0.1 penalties still to come). Debug: a row with one turn means the turns
    were cut by ``max_tokens_per_turn`` and never stepped (see the stop tokens below)."""
    import agentloop_trainer.stages.grpo as grpo
    from agentloop_tools.env_agent import EnvAgentLoop
    from agentloop_trainer.cli import main

    sampling = EnvAgentLoop._sampling

    def every_token_ends_a_turn(self, params):
        # A random model never writes its end-of-turn token: make any token end a turn, so
        # each turn ends cleanly and is stepped (as test_env_on_hf_server does).
        base, cap = sampling(self, params)
        return base.replace(stop_token_ids=tuple(range(len(self.tokenizer)))), cap

    monkeypatch.setattr(EnvAgentLoop, "_sampling", every_token_ends_a_turn)
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []
    real = grpo.credit_advantages

    def spy(settings, batch, groups):
        assert settings.mode == "discounted"
        adv = real(settings, batch, groups)
        seen.append((adv.clone(), torch.as_tensor(batch.response_mask).clone()))
        return adv

    monkeypatch.setattr(grpo, "credit_advantages", spy)
    monkeypatch.chdir(tmp_path)
    assert main(["data", "env", "number_guess", "--out", "envs/ng", "--n-train", "8", "--n-val", "2"]) == 0
    assert main(["train", f"model.path={random_model_path}", "data.train_files=envs/ng/train.parquet",
                 "data.val_files=envs/ng/val.parquet", "data.train_batch_size=2", "actor_rollout_ref.rollout.n=3",
                 "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=4",
                 "actor_rollout_ref.rollout.multi_turn.max_tokens_per_turn=4", "data.max_response_length=96",
                 "trainer.total_steps=2", "trainer.test_freq=0", "trainer.save_freq=0",
                 "trainer.experiment_name=turn_credit", "algorithm.turn_credit=discounted",
                 "algorithm.turn_gamma=0.9"]) == 0
    steps = [json.loads(line) for line in Path("outputs/turn_credit/metrics.jsonl").read_text().splitlines()]
    train = [s for s in steps if "actor/pg_loss" in s]
    assert [s["step"] for s in train] == [1, 2]
    assert all(math.isfinite(s["actor/pg_loss"]) for s in train)
    assert len(seen) == 2
    for adv, mask in seen:
        assert adv.shape == mask.shape
        assert (adv[mask == 0] == 0).all()
        for row in range(len(adv)):
            runs = mask_runs(mask[row].tolist())
            assert len(runs) > 1, "every trajectory should take several turns"
            per_turn = {round(float(adv[row, a]), 6) for a, _ in runs}
            assert len(per_turn) > 1, (row, runs, adv[row])
