"""GRPO math against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from agentloop_trainer.update import (
    aggregate_loss,
    compute_advantages,
    group_advantages,
    kl_k3,
    ppo_clip_loss,
    truncated_importance_weight,
)


def test_group_advantages_hand_values():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0])
    groups = ["a"] * 4 + ["b"] * 4
    adv = group_advantages(rewards, groups, eps=0.0)
    # group a: mean 0.25, unbiased std 0.5; group b: mean 0.5, std sqrt(1/3)
    expected = [1.5, -0.5, -0.5, -0.5] + [0.5 / math.sqrt(1 / 3)] * 2 + [-0.5 / math.sqrt(1 / 3)] * 2
    assert torch.allclose(adv, torch.tensor(expected), atol=1e-5)


def test_dr_grpo_only_centres():
    adv = compute_advantages("dr_grpo", torch.tensor([1.0, 0.0, 0.0, 0.0]), [0, 0, 0, 0])
    assert torch.allclose(adv, torch.tensor([0.75, -0.25, -0.25, -0.25]))


def test_identical_rewards_and_singletons_get_zero():
    adv = group_advantages(torch.tensor([1.0, 1.0, 0.3]), ["x", "x", "y"])
    assert torch.equal(adv, torch.zeros(3))


def test_unknown_estimator_is_named():
    with pytest.raises(ValueError, match="vtrace.*grpo"):
        compute_advantages("vtrace", torch.zeros(2), [0, 0])
    with pytest.raises(ValueError, match="gae' reads a value model's per-token values.*Critic.score"):
        compute_advantages("gae", torch.zeros(2), [0, 0])


def _ratios_to_logps(ratios):
    old = torch.log(torch.tensor([[0.3, 0.4, 0.5]]))
    return old + torch.log(torch.tensor([ratios])), old


@pytest.mark.parametrize(("adv", "expected"), [(1.0, (-1.2 - 0.5 - 1.0) / 3), (-1.0, (1.5 + 0.8 + 1.0) / 3)])
def test_ppo_clip_loss_hand_values(adv, expected):
    logp, old = _ratios_to_logps([1.5, 0.5, 1.0])
    loss, metrics = ppo_clip_loss(logp, old, torch.tensor([adv]), torch.ones(1, 3), clip_ratio_low=0.2, clip_ratio_high=0.2)
    assert float(loss) == pytest.approx(expected, abs=1e-6)
    # exactly one of the three tokens is clipped in either sign
    assert metrics["actor/pg_clipfrac"] == pytest.approx(1 / 3)


def test_masked_tokens_get_zero_gradient():
    torch.manual_seed(0)
    logp = (torch.randn(2, 5) - 2).requires_grad_(True)
    old = logp.detach() + 0.05 * torch.randn(2, 5)
    mask = torch.tensor([[1, 1, 0, 1, 0], [0, 1, 1, 0, 0]])
    loss, _ = ppo_clip_loss(logp, old, torch.tensor([1.0, -0.7]), mask)
    loss.backward()
    assert torch.all(logp.grad[mask == 0] == 0)
    assert torch.all(logp.grad[mask == 1] != 0)


def test_token_mean_weights_tokens_not_sequences():
    per_token = torch.tensor([[1.0, 1.0, 1.0, 1.0], [4.0, 0.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 0, 0, 0]])
    assert float(aggregate_loss(per_token, mask, "token-mean")) == pytest.approx(8 / 5)
    assert float(aggregate_loss(per_token, mask, "seq-mean-token-mean")) == pytest.approx((1 + 4) / 2)
    assert float(aggregate_loss(per_token, mask, "seq-mean-token-sum")) == pytest.approx((4 + 4) / 2)
    with pytest.raises(ValueError, match="token-mean"):
        aggregate_loss(per_token, mask, "sum")


def test_kl_k3_values():
    logp = torch.tensor([-1.0, -2.0])
    ref = torch.tensor([-1.0, -1.5])
    d = 0.5
    assert torch.allclose(kl_k3(logp, ref), torch.tensor([0.0, math.exp(d) - d - 1]))


def test_truncated_importance_weight_is_capped_and_detached():
    old = torch.tensor([-1.0, -1.0, -1.0], requires_grad=True)
    rollout = torch.tensor([-1.0, -1.5, -5.0])
    w = truncated_importance_weight(old, rollout, cap=2.0)
    assert torch.allclose(w, torch.tensor([1.0, math.exp(0.5), 2.0]))
    assert not w.requires_grad


def test_importance_weight_scales_the_loss():
    logp, old = _ratios_to_logps([1.0, 1.0, 1.0])
    base, _ = ppo_clip_loss(logp, old, torch.tensor([1.0]), torch.ones(1, 3))
    weighted, _ = ppo_clip_loss(logp, old, torch.tensor([1.0]), torch.ones(1, 3), importance_weight=torch.full((1, 3), 0.5))
    assert float(weighted) == pytest.approx(0.5 * float(base))
