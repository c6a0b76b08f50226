"""GAE, whitening, token rewards and the clipped value loss against hand-computed numbers
(update/gae.py). Each case's arithmetic is written out in its docstring: if one fails, redo it by
hand with the same inputs and compare with the recursion in ``compute_gae_advantage_return``."""

from __future__ import annotations

import pytest
import torch

from agentloop_trainer.update.gae import (
    clipped_value_loss,
    compute_gae_advantage_return,
    explained_variance,
    masked_whiten,
    token_level_rewards,
)

GAMMA, LAM = 0.9, 0.8


def test_gae_on_three_model_tokens_matches_the_hand_computation():
    """r = [0, 0, 1], V = [0.5, 0.6, 0.7], gamma 0.9, lam 0.8 (gamma * lam = 0.72):
    t=2: delta = 1 - 0.7 = 0.3, A = 0.3;
    t=1: delta = 0.9 * 0.7 - 0.6 = 0.03, A = 0.03 + 0.72 * 0.3 = 0.246;
    t=0: delta = 0.9 * 0.6 - 0.5 = 0.04, A = 0.04 + 0.72 * 0.246 = 0.21712;
    returns = A + V = [0.71712, 0.846, 1.0]."""
    adv, ret = compute_gae_advantage_return(torch.tensor([[0.0, 0.0, 1.0]]), torch.tensor([[0.5, 0.6, 0.7]]),
                                            torch.ones(1, 3), GAMMA, LAM, whiten=False)
    torch.testing.assert_close(adv, torch.tensor([[0.21712, 0.246, 0.3]]))
    torch.testing.assert_close(ret, torch.tensor([[0.71712, 0.846, 1.0]]))


def test_tool_tokens_are_skipped_not_discounted():
    """Model token, two tool tokens (mask 0), model token, padding; V = [0.5, 9, 9, 0.7, 9] (the 9s
    are never read), reward 1 on the last model token. The tool tokens are observations: the
    first model token bootstraps from the value at the next *model* token and is discounted
    once: t=3: A = 1 - 0.7 = 0.3; t=0: delta = 0.9 * 0.7 - 0.5 = 0.13, A = 0.13 + 0.72 * 0.3 =
    0.346. Masked positions get advantage and return 0."""
    mask = torch.tensor([[1.0, 0.0, 0.0, 1.0, 0.0]])
    adv, ret = compute_gae_advantage_return(torch.tensor([[0.0, 0.0, 0.0, 1.0, 0.0]]),
                                            torch.tensor([[0.5, 9.0, 9.0, 0.7, 9.0]]), mask, GAMMA, LAM, whiten=False)
    torch.testing.assert_close(adv, torch.tensor([[0.346, 0.0, 0.0, 0.3, 0.0]]))
    torch.testing.assert_close(ret, torch.tensor([[0.846, 0.0, 0.0, 1.0, 0.0]]))


def test_rows_are_independent_and_a_failed_row_gets_zeros():
    """Row 0: one model token, r = 2, V = 0.5: A = 1.5, return 2. Row 1 failed (mask all 0)."""
    adv, ret = compute_gae_advantage_return(torch.tensor([[2.0, 0.0], [0.0, 0.0]]),
                                            torch.tensor([[0.5, 0.0], [0.3, 0.4]]),
                                            torch.tensor([[1.0, 0.0], [0.0, 0.0]]), GAMMA, LAM, whiten=False)
    torch.testing.assert_close(adv, torch.tensor([[1.5, 0.0], [0.0, 0.0]]))
    torch.testing.assert_close(ret, torch.tensor([[2.0, 0.0], [0.0, 0.0]]))


def test_whitening_is_over_the_batchs_model_tokens():
    """Unwhitened A on the mask: 1, 2, 3 (the 100 is padding): mean 2, unbiased variance 1, so
    whitened -1, 0, 1; padding 0 (verl's masked_whiten)."""
    white = masked_whiten(torch.tensor([[1.0, 2.0], [3.0, 100.0]]), torch.tensor([[1.0, 1.0], [1.0, 0.0]]))
    torch.testing.assert_close(white, torch.tensor([[-1.0, 0.0], [1.0, 0.0]]))


def test_gae_whitens_by_default():
    rewards = torch.tensor([[0.0, 1.0], [0.0, 0.0]])
    values = torch.zeros(2, 2)
    mask = torch.ones(2, 2)
    adv, ret = compute_gae_advantage_return(rewards, values, mask, 1.0, 1.0)
    raw, _ = compute_gae_advantage_return(rewards, values, mask, 1.0, 1.0, whiten=False)
    torch.testing.assert_close(adv, masked_whiten(raw, mask))
    torch.testing.assert_close(ret, torch.tensor([[1.0, 1.0], [0.0, 0.0]]))  # returns are never whitened


def test_the_reward_goes_on_the_last_model_token():
    out = token_level_rewards(torch.tensor([2.0, 5.0, 3.0]),
                              torch.tensor([[1.0, 1.0, 0.0, 1.0, 0.0], [0.0] * 5, [1.0, 0.0, 0.0, 0.0, 0.0]]))
    torch.testing.assert_close(out, torch.tensor([[0.0, 0.0, 0.0, 2.0, 0.0], [0.0] * 5, [3.0, 0.0, 0.0, 0.0, 0.0]]))


def test_shapes_that_disagree_are_named():
    with pytest.raises(ValueError, match=r"must have one shape \[B, R\]"):
        compute_gae_advantage_return(torch.zeros(1, 2), torch.zeros(1, 3), torch.ones(1, 2), 1.0, 1.0)
    with pytest.raises(ValueError, match="give one reward per row"):
        token_level_rewards(torch.zeros(3), torch.ones(2, 4))


def test_value_clipping_matches_the_hand_computation():
    """clip 0.2; V = [1.0, 0.0, 0.6], V_old = [0.5, 0.5, 0.5], G = [2.0, 0.0, 0.0]:
    token 0: unclipped (1 - 2)^2 = 1, clipped V = 0.7: 1.69 -> 1.69 (clip acts);
    token 1: unclipped 0, clipped V = 0.3: 0.09 -> 0.09 (clip acts);
    token 2: inside the range: 0.36 both -> 0.36.
    loss = 0.5 * (1.69 + 0.09 + 0.36) / 3 = 0.35667; clip fraction 2/3. The gradient flows only
    where the unclipped error counts: dL/dV = [0, 0, 0.5 * 2 * 0.6 / 3 = 0.2]."""
    values = torch.tensor([[1.0, 0.0, 0.6]], requires_grad=True)
    out = clipped_value_loss(values, torch.full((1, 3), 0.5), torch.tensor([[2.0, 0.0, 0.0]]), torch.ones(1, 3), 0.2)
    torch.testing.assert_close(out.loss, torch.tensor(0.5 * 2.14 / 3))
    assert out.clipped_tokens == 2.0
    out.loss.backward()
    assert values.grad is not None
    torch.testing.assert_close(values.grad, torch.tensor([[0.0, 0.0, 0.2]]))


def test_the_clip_fraction_counts_no_token_inside_the_clip_range():
    """Old values near 0 and new ones ~0.1 (all inside the 0.2 range): ``old + (V - old)`` rounds
    to a neighbouring float for some tokens, which used to make a few of them count as clipped by
    rounding alone (3 of 2048 here; on two FSDP ranks the rounding fell elsewhere, and the clip
    fractions of one process and two ranks differed by 0.125). The loss is that of no clip."""
    g = torch.Generator().manual_seed(0)
    old = torch.randn(64, 32, generator=g) * 1e-3
    values = ((torch.rand(64, 32, generator=g) - 0.5) * 0.3).requires_grad_()
    returns = torch.randn(64, 32, generator=g)
    assert float((values.detach() - old).abs().max()) < 0.2
    out = clipped_value_loss(values, old, returns, torch.ones(64, 32), 0.2)
    assert out.clipped_tokens == 0.0
    torch.testing.assert_close(out.loss, 0.5 * (values - returns).pow(2).mean(), rtol=0, atol=0)


def test_value_loss_ignores_masked_tokens_and_takes_a_normaliser():
    """Token 1 is masked; with normaliser 4 (a mini-batch of 4 tokens, this micro-batch 1 of
    them) the loss is 0.5 * (1 - 0)^2 / 4 = 0.125."""
    out = clipped_value_loss(torch.tensor([[1.0, 50.0]]), torch.tensor([[1.0, 0.0]]), torch.zeros(1, 2),
                             torch.tensor([[1.0, 0.0]]), 0.5, normaliser=4.0)
    torch.testing.assert_close(out.loss, torch.tensor(0.125))
    assert out.clipped_tokens == 0.0


def test_explained_variance():
    """Returns 0, 1, 2, 3 (unbiased var 5/3): values equal to them explain everything (1); the
    mean (1.5 everywhere) explains nothing: 1 - (5/3) / (5/3 + 1e-5) = 6e-6, about 0."""
    returns = torch.tensor([[0.0, 1.0], [2.0, 3.0]])
    mask = torch.ones(2, 2)
    assert explained_variance(returns, returns, mask) == pytest.approx(1.0)
    assert explained_variance(torch.full((2, 2), 1.5), returns, mask) == pytest.approx(0.0, abs=1e-5)
