"""FSDP2 (2 gloo ranks) gives the same loss trajectory as one process."""

from __future__ import annotations

import pytest
import torch

from agentloop_trainer.actor import ActorConfig, GRPOActor, PolicyBatch


def _batch(vocab: int):
    g = torch.Generator().manual_seed(0)
    prefix = torch.randint(0, vocab, (20,), generator=g).tolist()
    seqs, plens = [], []
    R = 12
    mask = torch.zeros(8, R)
    for b in range(8):
        p = 20 + int(torch.randint(0, 5, (1,), generator=g))
        r = 4 + int(torch.randint(0, R - 4, (1,), generator=g))
        seqs.append(prefix + torch.randint(0, vocab, (p - 20 + r,), generator=g).tolist())
        plens.append(p)
        mask[b, :r] = (torch.rand(r, generator=g) < 0.8).float()
    adv = torch.randn(8, generator=g)
    rollout = torch.zeros(8, R)  # tis off below; present to exercise the plumbing
    return PolicyBatch(seqs, plens, mask, rollout), adv


def _steps(model, steps: int = 3):
    actor = GRPOActor(model, ActorConfig(lr=1e-2, tis_cap=None))
    pb, adv = _batch(model.config.vocab_size)
    out = []
    # old log-probs fixed at step 0 (several PPO updates on one batch), so the ratio, the
    # clipping and the loss all move from step to step
    old = actor.compute_log_probs(pb)
    for _ in range(steps):
        m = actor.update(pb, adv, old)
        out.append((m["actor/pg_loss"], m["actor/grad_norm"]))
    return out


def _fsdp_rank(rank: int, model_path: str):
    from transformers import AutoModelForCausalLM

    from agentloop_trainer.fsdp import full_model_state, shard_policy

    torch.manual_seed(0)
    model = shard_policy(AutoModelForCausalLM.from_pretrained(model_path))
    losses = _steps(model)
    state = full_model_state(model)
    return losses, {k: v.clone() for k, v in state.items()} if rank == 0 else None


@pytest.mark.slow
def test_fsdp2_two_ranks_match_one_process(random_model_path):
    from transformers import AutoModelForCausalLM

    from agentloop_trainer.fsdp import spawn

    model = AutoModelForCausalLM.from_pretrained(str(random_model_path))
    single = _steps(model)
    assert abs(single[0][0]) > 1e-4 and single[0][1] > 1e-4
    (sharded, state) = spawn(_fsdp_rank, 2, str(random_model_path))
    assert_same_training(single, sharded, model, state)


def assert_same_training(single, sharded, model, state) -> None:
    """Per-step (loss, grad norm) and final weights of a sharded run equal the single process's."""
    for (l1, g1), (l2, g2) in zip(single, sharded, strict=True):
        assert l2 == pytest.approx(l1, abs=1e-5)
        assert g2 == pytest.approx(g1, rel=1e-4)
    # the losses move, so the three steps really updated the weights identically
    assert single[0][0] != pytest.approx(single[2][0], abs=1e-6)
    expected = model.state_dict()
    assert set(state) == set(expected)
    for name, value in expected.items():
        # Adam turns float-rounding differences in near-zero gradients into small steps, so
        # compare at well below one lr-sized (1e-2) update
        assert float((state[name] - value).abs().max()) < 2e-3, name


def test_on_policy_update_equals_update_with_recomputed_old_log_probs(random_model_path):
    from transformers import AutoModelForCausalLM

    results = []
    for recompute in (True, False):
        model = AutoModelForCausalLM.from_pretrained(str(random_model_path))
        actor = GRPOActor(model, ActorConfig(lr=1e-2, tis_cap=2.0))
        pb, adv = _batch(model.config.vocab_size)
        old = actor.compute_log_probs(pb) if recompute else None
        results.append(actor.update(pb, adv, old))
    for key in ("actor/pg_loss", "actor/grad_norm", "actor/tis_weight_mean", "rollout/logprob_abs_diff_max"):
        assert results[0][key] == pytest.approx(results[1][key], rel=1e-5, abs=1e-7), key
    with pytest.raises(ValueError, match="exactly one optimizer step"):
        GRPOActor(model, ActorConfig(ppo_epochs=2)).update(pb, adv, None)
