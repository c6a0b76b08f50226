"""RLOO, GSPO and rollout correction (sequence / masked IS, rejection) against numbers worked out
by hand here; then each one through the actor and a 3-step ``agentloop train``."""

from __future__ import annotations

import json
import math

import pytest
import torch

from agentloop_trainer.config import ConfigError, load_config
from agentloop_trainer.update import (
    ActorConfig,
    PolicyBatch,
    PolicyGradientActor,
    compute_advantages,
    gspo_log_ratio,
    ppo_clip_loss,
    rollout_correction,
    trajectory_advantages,
)

# --- RLOO -------------------------------------------------------------------------------------


def test_rloo_subtracts_the_mean_of_the_other_samples():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 3.0, 1.0, 2.0, 5.0])
    groups = ["a"] * 4 + ["b"] * 3 + ["c"]
    adv = compute_advantages("rloo", rewards, groups)
    # a: a 1 is compared with the others' mean (1+0+0)/3, a 0 with (1+0+1)/3.
    # b: 3 - (1+2)/2, 1 - (3+2)/2, 2 - (3+1)/2.  c: a group of one has no baseline.
    expected = [2 / 3, -2 / 3, -2 / 3, 2 / 3, 1.5, -1.5, 0.0, 0.0]
    torch.testing.assert_close(adv, torch.tensor(expected))
    # n/(n-1) times the GRPO-without-std (Dr. GRPO) advantage, group by group.
    dr = compute_advantages("dr_grpo", rewards, groups)
    torch.testing.assert_close(adv[:4], dr[:4] * 4 / 3)
    torch.testing.assert_close(adv[4:7], dr[4:7] * 3 / 2)


def test_rloo_counts_a_split_trajectory_once():
    # Trajectory 0 is two segments (rows 0, 1): the group is {1, 0, 0}, not {1, 1, 0, 0}.
    adv = trajectory_advantages("rloo", torch.tensor([1.0, 1.0, 0.0, 0.0]), ["g"] * 4, [0, 0, 1, 2])
    torch.testing.assert_close(adv, torch.tensor([1.0, 1.0, -0.5, -0.5]))


def test_rloo_needs_groups_of_two():
    with pytest.raises(ConfigError, match=r"rollout.n must be at least 2 with algorithm.adv_estimator=rloo"):
        load_config(["algorithm.adv_estimator=rloo", "actor_rollout_ref.rollout.n=1"])


# --- GSPO -------------------------------------------------------------------------------------

OLD = torch.tensor([[-1.0, -2.0, 0.0, 0.0], [-0.5, -1.5, -1.0, -3.0]])
MASK = torch.tensor([[1.0, 1.0, 0.0, 0.0], [1.0, 1.0, 1.0, 0.0]])
# Row A: log-ratios 0.2, 0.4 (mean 0.3). Row B: -0.1, 0.1, -0.3 (mean -0.1); its 4th token is
# masked, so its +5 changes nothing.
SHIFT = torch.tensor([[0.2, 0.4, 0.0, 0.0], [-0.1, 0.1, -0.3, 5.0]])


def _gspo(mode: str) -> tuple[float, dict[str, float], torch.Tensor]:
    logp = (OLD + SHIFT).requires_grad_(True)
    loss, metrics = ppo_clip_loss(logp, OLD, torch.tensor([1.0, -1.0]), MASK, clip_ratio_low=0.2,
                                  clip_ratio_high=0.2, loss_agg_mode=mode, loss_mode="gspo")
    loss.backward()
    assert logp.grad is not None
    return float(loss.detach()), metrics, logp.grad


def test_gspo_sequence_ratio_is_the_length_normalised_ratio():
    log_s = gspo_log_ratio(OLD + SHIFT, OLD, MASK)
    torch.testing.assert_close(log_s[0, :2], torch.full((2,), 0.3))
    torch.testing.assert_close(log_s[1, :3], torch.full((3,), -0.1))


def test_gspo_loss_clip_and_gradient_by_hand():
    s_a, s_b = math.exp(0.3), math.exp(-0.1)  # 1.3499, 0.9048
    assert s_a > 1.2
    assert 0.8 < s_b < 1.2
    # A (advantage +1) is clipped at 1.2: term -1.2 on both tokens, no gradient.
    # B (advantage -1) is inside the range: term +s_b on each of its 3 tokens.
    loss, metrics, grad = _gspo("seq-mean-token-mean")
    assert loss == pytest.approx((-1.2 + s_b) / 2, abs=1e-6)
    assert metrics["actor/pg_clipfrac"] == pytest.approx(2 / 5)  # A's 2 of the 5 tokens
    assert torch.all(grad[0] == 0)
    # Each B token's gradient is d(s_b)/d(mean log-prob) / 3 / 2 sequences = s_b / 6, the same
    # for every token (vanilla PPO would give each its own ratio), positive: descending it
    # makes a negative-advantage sequence less likely. The masked token gets none.
    torch.testing.assert_close(grad[1, :3], torch.full((3,), s_b / 6))
    assert grad[1, 3] == 0

    token_loss, _, token_grad = _gspo("token-mean")
    assert token_loss == pytest.approx((2 * -1.2 + 3 * s_b) / 5, abs=1e-6)
    torch.testing.assert_close(token_grad[1, :3], torch.full((3,), s_b / 5))


def test_vanilla_and_gspo_differ_only_in_the_ratio():
    logp = OLD + SHIFT
    vanilla, _ = ppo_clip_loss(logp, OLD, torch.tensor([1.0, -1.0]), MASK, loss_agg_mode="seq-mean-token-mean")
    # A: token ratios exp(0.2) = 1.22 and exp(0.4) = 1.49 are both clipped at 1.2: -1.2 each;
    # B (advantage -1): exp(-0.1) and exp(0.1) are inside [0.8, 1.2]; exp(-0.3) = 0.74 is below,
    # and with a negative advantage the clipped 0.8 is the larger term.
    b = (math.exp(-0.1) + math.exp(0.1) + 0.8) / 3
    assert float(vanilla.detach()) == pytest.approx((-1.2 + b) / 2, abs=1e-6)
    with pytest.raises(ValueError, match="vanilla, gspo"):
        ppo_clip_loss(logp, OLD, torch.tensor([1.0, -1.0]), MASK, loss_mode="gpo")


# --- rollout correction -----------------------------------------------------------------------

ROLLOUT = torch.zeros(2, 3)
# old - rollout: sequence 1 sums to 0.3, sequence 2 to 1.2 (its third token padded in row 0).
GAP = torch.tensor([[0.1, 0.2, 0.0], [0.5, 0.4, 0.3]])
RS_MASK = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])


def test_sequence_is_weights_are_the_capped_product():
    c = rollout_correction(GAP, ROLLOUT, RS_MASK, rollout_is="sequence", rollout_is_threshold=2.0)
    w1, w2 = math.exp(0.3), 2.0  # exp(1.2) = 3.32 is capped at 2
    torch.testing.assert_close(c.weights, torch.tensor([[w1, w1, 0.0], [w2, w2, w2]]))
    torch.testing.assert_close(c.mask, RS_MASK)  # IS weighs, it never masks
    assert c.metrics["rollout_corr/rollout_is_mean"] == pytest.approx((2 * w1 + 3 * w2) / 5, rel=1e-6)
    assert c.metrics["rollout_corr/rollout_is_ratio_fraction_high"] == pytest.approx(3 / 5)
    token = rollout_correction(GAP, ROLLOUT, RS_MASK, rollout_is="token", rollout_is_threshold=2.0)
    torch.testing.assert_close(token.weights, torch.exp(GAP) * RS_MASK)  # every token ratio < 2


def test_icepop_zeroes_weights_outside_the_bounds():
    c = rollout_correction(GAP, ROLLOUT, RS_MASK, rollout_is="sequence", rollout_is_threshold="0.5_2.0")
    w1 = math.exp(0.3)
    torch.testing.assert_close(c.weights, torch.tensor([[w1, w1, 0.0], [0.0, 0.0, 0.0]]))
    assert c.metrics["rollout_corr/rollout_is_oob_ratio"] == pytest.approx(3 / 5)


@pytest.mark.parametrize(("log_w", "kept"), [(math.log(2.0) - 1e-4, True), (math.log(2.0) + 1e-4, False),
                                             (math.log(0.5) + 1e-4, True), (math.log(0.5) - 1e-4, False)])
def test_icepop_at_the_thresholds(log_w, kept):
    gap = torch.tensor([[log_w / 2, log_w / 2]])  # a 2-token sequence whose ratio is exp(log_w)
    c = rollout_correction(gap, torch.zeros(1, 2), torch.ones(1, 2), rollout_is="sequence",
                           rollout_is_threshold="0.5_2.0")
    assert bool(c.weights[0, 0] > 0) is kept


def test_rejection_masks_sequences_and_tokens():
    # seq_sum_k1 keeps log(0.5) <= sum(rollout - old) <= log(2): -0.3 yes, -1.2 no.
    c = rollout_correction(GAP, ROLLOUT, RS_MASK, rollout_rs="seq_sum_k1", rollout_rs_threshold="0.5_2.0")
    torch.testing.assert_close(c.mask, torch.tensor([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0]]))
    assert c.weights is None
    assert c.metrics["rollout_corr/rollout_rs_masked_fraction"] == pytest.approx(3 / 5)
    assert c.metrics["rollout_corr/rollout_rs_seq_masked_fraction"] == pytest.approx(1 / 2)
    # seq_mean_k1 (geometric mean): sequence 2's mean is -0.4, inside: nothing rejected.
    geo = rollout_correction(GAP, ROLLOUT, RS_MASK, rollout_rs="seq_mean_k1", rollout_rs_threshold="0.5_2.0")
    torch.testing.assert_close(geo.mask, RS_MASK)
    # token_k1 with bounds 0.7..1.3: log(0.7) = -0.357, so -0.5 and -0.4 go, -0.3 stays.
    tok = rollout_correction(GAP, ROLLOUT, RS_MASK, rollout_rs="token_k1", rollout_rs_threshold="0.7_1.3")
    torch.testing.assert_close(tok.mask, torch.tensor([[1.0, 1.0, 0.0], [0.0, 0.0, 1.0]]))
    # Two options, one bound each: token_k2 <= 0.1 drops the 0.5 token (0.125); seq_max_k3 <= 0.2
    # drops nothing (exp(0.5) - 1.5 = 0.149).
    both = rollout_correction(GAP, ROLLOUT, RS_MASK, rollout_rs="token_k2,seq_max_k3", rollout_rs_threshold="0.1,0.2")
    torch.testing.assert_close(both.mask, torch.tensor([[1.0, 1.0, 0.0], [0.0, 1.0, 1.0]]))
    # Rejection and sequence IS together: the weights of rejected tokens are 0 too.
    mixed = rollout_correction(GAP, ROLLOUT, RS_MASK, rollout_is="sequence", rollout_rs="seq_sum_k1",
                               rollout_rs_threshold="0.5_2.0")
    assert torch.all(mixed.weights[1] == 0)
    assert mixed.weights[0, 0] == pytest.approx(math.exp(0.3))


def test_a_split_trajectory_is_one_sequence():
    # Rows 0 and 1 are segments of one trajectory: its log-ratio sum is 0.3 + 0.4 = 0.7.
    gap = torch.tensor([[0.1, 0.2], [0.4, 0.0], [0.5, 0.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0], [1.0, 0.0]])
    c = rollout_correction(gap, torch.zeros(3, 2), mask, rollout_is="sequence", rollout_is_threshold=10.0,
                           sequence_index=torch.tensor([0, 0, 1]))
    torch.testing.assert_close(c.weights[:, 0], torch.tensor([math.exp(0.7), math.exp(0.7), math.exp(0.5)]))


@pytest.mark.parametrize(("overrides", "match"), [
    (["algorithm.rollout_correction.rollout_is=sequence"], "set actor_rollout_ref.actor.tis_cap=null"),
    (["algorithm.rollout_correction.rollout_is=seq", "actor_rollout_ref.actor.tis_cap=null"], "rollout_is must be"),
    (["algorithm.rollout_correction.rollout_rs=token_k1"], "rollout_rs_threshold must be set"),
    (["algorithm.rollout_correction.rollout_rs=geo", "algorithm.rollout_correction.rollout_rs_threshold=2.0"],
     "unknown option"),
    (["algorithm.rollout_correction.rollout_rs=token_k3", "algorithm.rollout_correction.rollout_rs_threshold='1_2'"],
     "takes one upper bound"),
    (["algorithm.rollout_correction.bypass_mode=true"], "bypass_mode=True is not supported"),
    (["actor_rollout_ref.actor.policy_loss.loss_mode=gpg"], "loss_mode must be one of"),
])
def test_contradictory_or_bad_settings_are_named(overrides, match):
    with pytest.raises(ConfigError, match=match):
        load_config(overrides)


def _tiny_batch():
    seqs = [[5, 6, 7, 8, 9, 10], [5, 6, 7, 11, 12, 13], [5, 6, 14, 15, 16, 17]]
    mask = torch.ones(3, 3)
    rollout = torch.full((3, 3), -3.0)
    return PolicyBatch(seqs, [3, 3, 3], mask, rollout)


def test_rejected_rows_train_like_rows_that_were_never_there(random_model_path):
    """A row the rejection drops gives the update of a batch with that row masked out."""
    from transformers import AutoModelForCausalLM

    pb = _tiny_batch()
    adv = torch.tensor([1.0, -0.5, 0.7])
    model = AutoModelForCausalLM.from_pretrained(str(random_model_path), dtype=torch.float32)
    old = PolicyGradientActor(model, ActorConfig(tis_cap=None)).compute_log_probs(pb)
    # Row 2's engine log-probs are far from the trainer's: its sequence fails seq_mean_k3 <= 0.5.
    pb.rollout_log_probs = old.clone()
    pb.rollout_log_probs[2] -= 3.0

    def run(cfg, batch):
        m = AutoModelForCausalLM.from_pretrained(str(random_model_path), dtype=torch.float32)
        out = PolicyGradientActor(m, cfg).update(batch, adv, old)
        return out, torch.cat([p.detach().flatten() for p in m.parameters()])

    from agentloop_trainer.update.settings import RolloutCorrectionSection

    rc = RolloutCorrectionSection(rollout_rs="seq_mean_k3", rollout_rs_threshold=0.5)
    rejected, w_rejected = run(ActorConfig(tis_cap=None, lr=1e-2, rollout_correction=rc), pb)
    masked = PolicyBatch(pb.sequences, pb.prompt_lengths, pb.response_mask.clone(), pb.rollout_log_probs)
    masked.response_mask[2] = 0
    plain, w_plain = run(ActorConfig(tis_cap=None, lr=1e-2), masked)
    assert rejected["rollout_corr/rollout_rs_seq_masked_fraction"] == pytest.approx(1 / 3)
    assert rejected["actor/pg_loss"] == pytest.approx(plain["actor/pg_loss"], abs=1e-6)
    torch.testing.assert_close(w_rejected, w_plain)
    assert rejected["actor/grad_norm"] > 0


# --- 3-step runs ------------------------------------------------------------------------------

RUNS = {
    "rloo": ["algorithm.adv_estimator=rloo"],
    "gspo": ["actor_rollout_ref.actor.policy_loss.loss_mode=gspo", "actor_rollout_ref.actor.clip_ratio_low=0.0003",
             "actor_rollout_ref.actor.clip_ratio_high=0.0004", "actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-mean"],
    "seq_is_rejection": ["actor_rollout_ref.actor.tis_cap=null", "algorithm.rollout_correction.rollout_is=sequence",
                         "algorithm.rollout_correction.rollout_is_threshold=2.0",
                         "algorithm.rollout_correction.rollout_rs=seq_mean_k1",
                         "algorithm.rollout_correction.rollout_rs_threshold=0.5_2.0"],
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(RUNS))
def test_three_step_train_run(name, tmp_path, random_model_path):
    from agentloop_trainer.cli import main

    reward = tmp_path / "parity.py"  # a random policy never answers: score the length's parity
    reward.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                      "    return float(len(solution_str) % 2)\n")
    args = [f"model.path={random_model_path}", f"trainer.run_dir={tmp_path / 'run'}", "trainer.total_steps=3",
            "trainer.test_freq=0", "trainer.save_freq=0", "trainer.val_before_train=false", "trainer.progress_bar=false",
            "data.train_size=16", "data.val_size=2", "data.train_batch_size=2", "actor_rollout_ref.rollout.n=3",
            "actor_rollout_ref.rollout.multi_turn.max_tokens_per_turn=8", "data.max_response_length=24",
            "actor_rollout_ref.actor.ppo_mini_batch_size=1", f"custom_reward_function.path={reward}", *RUNS[name]]
    assert main(["train", *args]) == 0
    steps = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [s for s in steps if "actor/pg_loss" in s]
    assert [s["step"] for s in steps] == [1, 2, 3]
    assert all(math.isfinite(s["actor/pg_loss"]) and s["actor/num_updates"] == 2 for s in steps)
    if name == "seq_is_rejection":
        assert all(0 < s["rollout_corr/rollout_is_mean"] <= 2.0 for s in steps)
        assert all(0 <= s["rollout_corr/rollout_rs_masked_fraction"] <= 1 for s in steps)
        assert "actor/tis_weight_mean" not in steps[0]
    else:
        assert "rollout_corr/rollout_is_mean" not in steps[0]
