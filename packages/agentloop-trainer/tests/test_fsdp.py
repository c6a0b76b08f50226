"""FSDP2 (2 gloo ranks) gives the same loss trajectory as one process."""

from __future__ import annotations

import pytest
import torch

from agentloop_trainer.update import ActorConfig, PolicyBatch, PolicyGradientActor


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


SEGMENT_TRAJECTORIES = [0, 0, 1, 2, 2, 3, 4]
"""7 rows: trajectories 0 and 2 split into two segments each (an odd row count on purpose)."""


def _segmented_batch(vocab: int, world_size: int):
    from agentloop_trainer.update import sequence_weights

    pb, adv = _batch(vocab)
    mask = pb.response_mask[:7]
    adv = adv[torch.tensor(SEGMENT_TRAJECTORIES)]  # a trajectory's advantage on each of its rows
    pb = PolicyBatch(pb.sequences[:7], pb.prompt_lengths[:7], mask, pb.rollout_log_probs[:7],
                     sequence_weights(mask, SEGMENT_TRAJECTORIES))
    padded = pb.padded(world_size)
    return padded, torch.cat([adv, adv.new_zeros(len(padded.sequences) - len(adv))])


def _steps(model, steps: int = 3, ref=None, loss_agg_mode: str = "token-mean", segments: bool = False,
           world_size: int = 1):
    """(pg_loss, grad_norm[, kl_loss]) per step; with ``ref`` the k3 KL term is in the loss."""
    kl = {"use_kl_loss": True, "kl_loss_coef": 0.5} if ref is not None else {}
    actor = PolicyGradientActor(model, ActorConfig(lr=1e-2, tis_cap=None, loss_agg_mode=loss_agg_mode, **kl), ref_model=ref)
    if segments:
        pb, adv = _segmented_batch(model.config.vocab_size, world_size)
    else:
        pb, adv = _batch(model.config.vocab_size)
    out = []
    # old log-probs fixed at step 0 (several PPO updates on one batch), so the ratio, the
    # clipping and the loss all move from step to step
    old = actor.compute_log_probs(pb)
    for _ in range(steps):
        ref_lp = actor.compute_log_probs(pb, ref) if ref is not None else None
        m = actor.update(pb, adv, old, ref_lp)
        out.append((m["actor/pg_loss"], m["actor/grad_norm"]) + ((m["actor/kl_loss"],) if ref is not None else ()))
    return out


def _fsdp_rank(rank: int, model_path: str, with_ref: bool = False, loss_agg_mode: str = "token-mean",
               segments: bool = False):
    from transformers import AutoModelForCausalLM

    from agentloop_trainer.update import full_model_state, load_reference, shard_policy

    torch.manual_seed(0)
    model = shard_policy(AutoModelForCausalLM.from_pretrained(model_path))
    ref = load_reference(model_path) if with_ref else None
    losses = _steps(model, ref=ref, loss_agg_mode=loss_agg_mode, segments=segments, world_size=2)
    state = full_model_state(model)
    return losses, {k: v.clone() for k, v in state.items()} if rank == 0 else None


@pytest.mark.slow
def test_fsdp2_two_ranks_match_one_process(random_model_path):
    from transformers import AutoModelForCausalLM

    from agentloop_trainer.update import spawn

    model = AutoModelForCausalLM.from_pretrained(str(random_model_path))
    single = _steps(model)
    assert abs(single[0][0]) > 1e-4
    assert single[0][1] > 1e-4
    (sharded, state) = spawn(_fsdp_rank, 2, str(random_model_path))
    assert_same_training(single, sharded, model, state)


@pytest.mark.slow
def test_fsdp2_two_ranks_with_kl_to_a_sharded_reference_match_one_process(random_model_path):
    """The KL term to a frozen reference works under FSDP: the reference is sharded like the
    policy, and the per-step loss, grad norm, KL and final weights equal one process's. The
    sequence-mean mode checks the KL stays a token mean over the whole batch on every rank."""
    import copy

    from transformers import AutoModelForCausalLM

    from agentloop_trainer.update import spawn

    model = AutoModelForCausalLM.from_pretrained(str(random_model_path))
    ref = copy.deepcopy(model).eval().requires_grad_(False)
    single = _steps(model, ref=ref, loss_agg_mode="seq-mean-token-mean")
    assert single[0][2] == pytest.approx(0.0, abs=1e-7), "policy == reference before the first update"
    assert single[2][2] > 1e-5, "the KL must grow once the policy moves"
    (sharded, state) = spawn(_fsdp_rank, 2, str(random_model_path), True, "seq-mean-token-mean")
    for s1, s2 in zip(single, sharded, strict=True):
        assert s2[2] == pytest.approx(s1[2], rel=1e-4, abs=1e-8)
    assert_same_training(single, sharded, model, state)


@pytest.mark.slow
def test_fsdp2_two_ranks_on_segments_match_one_process(random_model_path):
    """A batch of segments has a row count the ranks need not divide (7 here): the trainer pads
    it with empty rows, and the sequence-mean loss, which counts a split trajectory once
    through its rows' weights, still equals the unpadded single process's."""
    from transformers import AutoModelForCausalLM

    from agentloop_trainer.update import spawn

    model = AutoModelForCausalLM.from_pretrained(str(random_model_path))
    single = _steps(model, loss_agg_mode="seq-mean-token-mean", segments=True)
    assert abs(single[0][0]) > 1e-4
    assert single[0][1] > 1e-4
    (sharded, state) = spawn(_fsdp_rank, 2, str(random_model_path), False, "seq-mean-token-mean", True)
    assert_same_training(single, sharded, model, state)


def assert_same_training(single, sharded, model, state) -> None:
    """Per-step (loss, grad norm) and final weights of a sharded run equal the single process's."""
    for (l1, g1, *_), (l2, g2, *_) in zip(single, sharded, strict=True):
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
        actor = PolicyGradientActor(model, ActorConfig(lr=1e-2, tis_cap=2.0))
        pb, adv = _batch(model.config.vocab_size)
        old = actor.compute_log_probs(pb) if recompute else None
        results.append(actor.update(pb, adv, old))
    for key in ("actor/pg_loss", "actor/grad_norm", "actor/tis_weight_mean", "rollout/logprob_abs_diff_max"):
        assert results[0][key] == pytest.approx(results[1][key], rel=1e-5, abs=1e-7), key
    with pytest.raises(ValueError, match="exactly one optimizer step"):
        PolicyGradientActor(model, ActorConfig(ppo_epochs=2)).update(pb, adv, None)


@pytest.mark.slow
def test_agentloop_train_on_two_fsdp_ranks_with_the_kl_loss(random_model_path, tmp_path):
    """The whole command on 2 gloo ranks: rank 0 rolls out, both ranks train their half of the
    batch against a sharded reference, and the full weights reach the engine after each step."""
    import json

    from agentloop_trainer.cli import run_train
    from agentloop_trainer.config import load_config

    cfg = load_config([
        f"model.path={random_model_path}", "data.train_size=32", "data.val_size=4", "data.train_batch_size=2",
        "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.rollout.multi_turn.max_tokens_per_turn=12",
        "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=2", "data.max_response_length=40",
        "actor_rollout_ref.actor.use_kl_loss=true", "actor_rollout_ref.actor.kl_loss_coef=0.1",
        "actor_rollout_ref.actor.lr=1e-2", "trainer.fsdp_ranks=2", "trainer.total_steps=2", "trainer.test_freq=0",
        "trainer.save_freq=0", "trainer.progress_bar=false", f"trainer.output_dir={tmp_path}",
        "trainer.experiment_name=fsdp-kl",
    ])
    run_dir, summary = run_train(cfg, log=lambda *_: None)
    assert summary["steps"] == 2
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in steps if "reward/mean" in m]
    assert [m["step"] for m in steps] == [1, 2]
    # The random policy earns no reward, so the advantages are zero and the policy stays at the
    # reference: the KL is computed on both ranks and is 0. (That it grows and matches one
    # process once the policy moves is the sharded-reference test above.)
    assert all(m["actor/kl_loss"] == pytest.approx(0.0, abs=1e-7) for m in steps)
    assert all(m["rollout/num_failed"] == 0 and m["rollout/generated_tokens"] > 0 for m in steps)
    # the rollout's batch metrics reach metrics.jsonl: per-loop timings and the tool counters
    assert all("timing_s/agent_loop/generate/mean" in m and "agent_loop/tool_calls/mean" in m for m in steps)
    # save_freq=0 still ends with the policy as a Hugging Face folder, gathered from both ranks' shards.
    from transformers import AutoModelForCausalLM

    assert summary["final_hf_dir"] == str(run_dir / "final" / "hf")
    assert AutoModelForCausalLM.from_pretrained(summary["final_hf_dir"]).num_parameters() > 0
