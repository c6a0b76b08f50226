"""Advantage estimators, policy losses and rollout-correction options are tables: a new one is
one registration, and the config checks, the errors and the update read it from there."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch

from agentloop_trainer.config import ConfigError, load_config
from agentloop_trainer.update import (
    ADVANTAGE_ESTIMATORS,
    IMPORTANCE_LEVELS,
    POLICY_LOSSES,
    REJECTION_OPTIONS,
    AlgorithmTable,
    RejectionOption,
    UnknownAlgorithmError,
    compute_advantages,
    ppo_clip_loss,
    register_advantage_estimator,
    register_policy_loss,
    rollout_correction,
    trajectory_advantages,
)
from agentloop_trainer.update.losses import PolicyTerms
from agentloop_trainer.update.settings import AlgorithmSection, PolicyLossSection

CALLS: list[int] = []


def _median_baseline(rewards, group_ids):
    """Each reward minus its group's median (a made-up estimator)."""
    CALLS.append(len(group_ids))
    out = torch.zeros_like(rewards)
    for g in set(group_ids):
        idx = torch.tensor([i for i, x in enumerate(group_ids) if x == g])
        out[idx] = rewards[idx] - rewards[idx].median()
    return out


@pytest.fixture
def median_baseline():
    """``algorithm.adv_estimator=median_baseline``, registered in one place and removed after."""
    register_advantage_estimator("median_baseline", min_group_size=3, why="a median of fewer says little",
                                 summary="reward minus its group's median")(_median_baseline)
    CALLS.clear()
    yield "median_baseline"
    ADVANTAGE_ESTIMATORS.remove("median_baseline")


def test_a_registered_estimator_loads_and_computes(median_baseline):
    cfg = load_config([f"algorithm.adv_estimator={median_baseline}", "actor_rollout_ref.rollout.n=3"])
    assert cfg.algorithm.adv_estimator == median_baseline
    adv = compute_advantages(median_baseline, [1.0, 0.0, 0.5, 2.0, 2.0, 0.0], [0, 0, 0, 1, 1, 1])
    torch.testing.assert_close(adv, torch.tensor([0.5, -0.5, 0.0, 0.0, 0.0, -2.0]))
    # Segments: the estimator sees each trajectory once, and every row gets its trajectory's value.
    rows = trajectory_advantages(median_baseline, [1.0, 1.0, 0.0, 0.5], ["a", "a", "a", "a"], [0, 0, 1, 2])
    torch.testing.assert_close(rows, torch.tensor([0.5, 0.5, -0.5, 0.0]))
    assert CALLS == [6, 3]


def test_the_group_size_an_estimator_needs_is_checked_at_load(median_baseline):
    with pytest.raises(ConfigError, match=r"rollout.n must be at least 3 with algorithm.adv_estimator="
                                          r"median_baseline \(a median of fewer says little\)"):
        load_config([f"algorithm.adv_estimator={median_baseline}", "actor_rollout_ref.rollout.n=2"])


def test_an_estimator_that_needs_a_critic_asks_for_the_critics_keys_at_load():
    register_advantage_estimator("value_baseline", needs_critic=True)(_median_baseline)
    try:
        with pytest.raises(ConfigError, match=r"critic\.optim\.lr must be set .* with "
                                              r"algorithm\.adv_estimator=value_baseline"):
            load_config(["algorithm.adv_estimator=value_baseline"])
        load_config(["algorithm.adv_estimator=value_baseline", "critic.optim.lr=1e-4"])
    finally:
        ADVANTAGE_ESTIMATORS.remove("value_baseline")


def test_unknown_names_list_the_table_and_how_to_add_one():
    with pytest.raises(UnknownAlgorithmError, match=r"unknown adv_estimator 'ppo'; valid: grpo, dr_grpo, rloo, gae\. "
                                                    r"Register one with .*register_advantage_estimator"):
        compute_advantages("ppo", [1.0, 0.0], [0, 0])
    with pytest.raises(ConfigError, match=r"adv_estimator must be one of \('grpo', 'dr_grpo', 'rloo', 'gae'\)"):
        load_config(["algorithm.adv_estimator=ppo"])
    with pytest.raises(ValueError, match="must be null or one of token, sequence"):
        rollout_correction(torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1, 2), rollout_is="row")


def test_a_taken_name_is_refused():
    with pytest.raises(ValueError, match="adv_estimator name 'grpo' is already registered"):
        register_advantage_estimator("grpo")(_median_baseline)
    assert ADVANTAGE_ESTIMATORS.get("grpo").estimate is not _median_baseline
    with pytest.raises(ValueError, match="min_group_size must be at least 1"):
        register_advantage_estimator("empty", min_group_size=0)


def test_an_estimator_of_the_wrong_shape_is_named():
    register_advantage_estimator("scalar")(lambda rewards, group_ids: rewards.mean())
    try:
        with pytest.raises(ValueError, match=r"estimator 'scalar' returned shape \(\) for \(2,\) rewards"):
            compute_advantages("scalar", [1.0, 0.0], [0, 0])
    finally:
        ADVANTAGE_ESTIMATORS.remove("scalar")


def test_the_built_in_constraints_are_in_the_table():
    assert ADVANTAGE_ESTIMATORS.names() == ["grpo", "dr_grpo", "rloo", "gae"]
    assert [e.min_group_size for e in ADVANTAGE_ESTIMATORS] == [1, 1, 2, 1]
    assert [e.needs_critic for e in ADVANTAGE_ESTIMATORS] == [False, False, False, True]
    assert {p.name: p.level for p in POLICY_LOSSES} == {"vanilla": "token", "gspo": "sequence"}
    assert IMPORTANCE_LEVELS.names() == ["token", "sequence"]
    assert [o.name for o in REJECTION_OPTIONS if o.bounds == "ratio"] == ["token_k1", "seq_sum_k1", "seq_mean_k1"]
    assert len(REJECTION_OPTIONS.names()) == 11


def test_the_config_docstrings_name_every_built_in():
    sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tools" / "docs"))
    import config_reference  # pyright: ignore[reportMissingImports]

    docs = config_reference.field_docs(AlgorithmSection)["adv_estimator"]
    assert all(name in docs for name in ADVANTAGE_ESTIMATORS.names()), docs
    docs = config_reference.field_docs(PolicyLossSection)["loss_mode"]
    assert all(name in docs for name in POLICY_LOSSES.names()), docs


def _unclipped(log_probs, old_log_probs, advantages, response_mask, *, clip_ratio_low, clip_ratio_high):
    ratio = torch.exp(log_probs - old_log_probs)
    return PolicyTerms(-advantages * ratio, ratio, torch.zeros_like(ratio, dtype=torch.bool))


def test_a_registered_policy_loss_loads_and_trains():
    register_policy_loss("unclipped", level="token")(_unclipped)
    try:
        cfg = load_config(["actor_rollout_ref.actor.policy_loss.loss_mode=unclipped"])
        assert cfg.actor_rollout_ref.actor.policy_loss.loss_mode == "unclipped"
        logp = torch.log(torch.tensor([[0.5, 0.9]])).requires_grad_()
        old = torch.log(torch.tensor([[0.25, 0.3]]))
        loss, metrics = ppo_clip_loss(logp, old, torch.tensor([1.0]), torch.ones(1, 2), loss_mode="unclipped")
        assert float(loss.detach()) == pytest.approx(-(2.0 + 3.0) / 2)  # ratios 2 and 3, far outside the clip
        assert metrics["actor/pg_clipfrac"] == 0.0
    finally:
        POLICY_LOSSES.remove("unclipped")
    with pytest.raises(ConfigError, match=r"loss_mode must be one of \('vanilla', 'gspo'\)"):
        load_config(["actor_rollout_ref.actor.policy_loss.loss_mode=unclipped"])


def test_a_registered_rejection_option_is_accepted():
    REJECTION_OPTIONS.add("token_abs", RejectionOption("token_abs", torch.abs, "token", "upper"))
    try:
        load_config(["algorithm.rollout_correction.rollout_rs=token_abs",
                     "algorithm.rollout_correction.rollout_rs_threshold=0.5"])
        gap = torch.tensor([[0.1, -0.9]])
        c = rollout_correction(gap, torch.zeros(1, 2), torch.ones(1, 2), rollout_rs="token_abs",
                               rollout_rs_threshold=0.5)
        assert c.mask.tolist() == [[1.0, 0.0]]
    finally:
        REJECTION_OPTIONS.remove("token_abs")


def test_a_table_keeps_registration_order_and_removes_cleanly():
    table: AlgorithmTable[int] = AlgorithmTable("thing", "agentloop.test_things", int, "Add one.")
    table.add("b", 1)
    table.add("a", 2)
    table.add("b", 1)  # the same record again: harmless
    assert table.names() == ["b", "a"]
    assert "a" in table
    assert table.find("c") is None
    table.remove("b")
    with pytest.raises(UnknownAlgorithmError, match=r"unknown thing 'b'; valid: a\. Add one\."):
        table.remove("b")


def test_an_installed_package_adds_an_estimator_by_entry_point(tmp_path, monkeypatch):
    """A package names its module in ``agentloop.advantage_estimators``; the module's decorator
    registers the estimator when the name is first asked for (a fresh ``agentloop train`` finds it)."""
    from importlib.metadata import EntryPoint

    import agentloop_core.plugins

    (tmp_path / "my_estimators.py").write_text(
        "from agentloop_trainer.update import register_advantage_estimator\n\n"
        "@register_advantage_estimator('sign', summary='the sign of the reward')\n"
        "def sign(rewards, group_ids):\n"
        "    return rewards.sign()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    found = [EntryPoint("sign", "my_estimators:sign", "agentloop.advantage_estimators"),
             EntryPoint("broken", "no_such_module:thing", "agentloop.advantage_estimators")]
    real = agentloop_core.plugins.entry_points
    monkeypatch.setattr(agentloop_core.plugins, "entry_points",
                        lambda group: found if group == "agentloop.advantage_estimators" else real(group=group))
    saved = ADVANTAGE_ESTIMATORS.snapshot()
    try:
        assert load_config(["algorithm.adv_estimator=sign"]).algorithm.adv_estimator == "sign"
        torch.testing.assert_close(compute_advantages("sign", [2.0, -0.5], [0, 0]), torch.tensor([1.0, -1.0]))
        with pytest.raises(ValueError, match="adv_estimator 'broken' is installed but broken: .*no_such_module"):
            compute_advantages("broken", [1.0], [0])
    finally:
        ADVANTAGE_ESTIMATORS.restore(saved)


@pytest.mark.slow
def test_a_train_step_uses_a_registered_estimator(median_baseline, tmp_path, random_model_path):
    """The whole command, in this process: one step with the estimator registered above."""
    from agentloop_trainer.cli import main

    reward = tmp_path / "parity.py"  # a random policy never answers: score the length's parity
    reward.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                      "    return float(len(solution_str) % 2)\n")
    args = [f"model.path={random_model_path}", f"trainer.run_dir={tmp_path / 'run'}", "trainer.total_steps=1",
            "trainer.test_freq=0", "trainer.save_freq=0", "trainer.val_before_train=false",
            "trainer.progress_bar=false", "data.train_size=4", "data.val_size=2", "data.train_batch_size=2",
            "actor_rollout_ref.rollout.n=3", "actor_rollout_ref.rollout.multi_turn.max_tokens_per_turn=8",
            "data.max_response_length=16", f"custom_reward_function.path={reward}",
            f"algorithm.adv_estimator={median_baseline}"]
    assert main(["train", *args]) == 0
    assert CALLS[:1] == [6]  # 2 prompts x 3 samples, one call per step
    steps = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps if "actor/pg_loss" in s] == [1]
    assert all(math.isfinite(s["actor/pg_loss"]) for s in steps if "actor/pg_loss" in s)
