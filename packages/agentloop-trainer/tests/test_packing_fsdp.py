"""Packed updates under FSDP2 (2 gloo ranks, each packing its own rows) and in a whole
``agentloop train`` run."""

from __future__ import annotations

import pytest
import torch
from test_packing import _multi_turn_batch

from agentloop_trainer.update import ActorConfig, PolicyGradientActor

BUDGET = {"use_dynamic_bsz": True, "ppo_max_token_len_per_gpu": 70, "loss_agg_mode": "seq-mean-token-mean"}
"""Token-budget micro-batches: the two ranks need different numbers of packed passes."""


def _train(model, packed: bool, world_size: int = 1):
    """(pg_loss, grad_norm) of two PPO updates on the multi-turn batch (padded to the ranks)."""
    pb, adv = _multi_turn_batch(model.config.vocab_size)
    pb = pb.padded(2)
    adv = torch.cat([adv, adv.new_zeros(len(pb.sequences) - len(adv))])
    actor = PolicyGradientActor(model, ActorConfig(lr=1e-2, tis_cap=None, use_remove_padding=packed, **BUDGET))
    assert actor.packed is packed
    old = actor.compute_log_probs(pb)
    return [(m["actor/pg_loss"], m["actor/grad_norm"], m["actor/micro_batches"])
            for m in (actor.update(pb, adv, old) for _ in range(2))], old


def _rank(rank: int, model_path: str, packed: bool):
    from transformers import AutoModelForCausalLM

    from agentloop_trainer.update import full_model_state, shard_policy

    torch.manual_seed(0)
    model = shard_policy(AutoModelForCausalLM.from_pretrained(model_path))
    steps, old = _train(model, packed, world_size=2)
    state = full_model_state(model)
    return steps, old, {k: v.clone() for k, v in state.items()} if rank == 0 else None


@pytest.mark.slow
def test_two_fsdp_ranks_packed_match_padded(random_model_path):
    """Each rank packs its own rows by the token budget (uneven pass counts are evened with
    stand-in passes); old log-probs, per-step loss and grad norm, and the final weights equal
    the padded ranks' and the one padded process's."""
    from transformers import AutoModelForCausalLM

    from agentloop_trainer.update import spawn

    model = AutoModelForCausalLM.from_pretrained(str(random_model_path))
    single, single_old = _train(model, packed=False)
    runs = {packed: spawn(_rank, 2, str(random_model_path), packed) for packed in (False, True)}
    for packed, (steps, old, state) in runs.items():
        torch.testing.assert_close(old, single_old, atol=1e-5, rtol=0, msg=f"old log-probs, packed={packed}")
        for (l1, g1, _), (l2, g2, _) in zip(single, steps, strict=True):
            assert l2 == pytest.approx(l1, abs=1e-5), packed
            assert g2 == pytest.approx(g1, rel=1e-4), packed
        for name, value in model.state_dict().items():
            torch.testing.assert_close(state[name], value, atol=5e-5, rtol=0, msg=f"{name}, packed={packed}")
    # packing fills each pass up to the budget: fewer passes than padding for the same rows
    assert runs[True][0][0][2] < runs[False][0][0][2]


@pytest.mark.slow
def test_agentloop_train_runs_packed(tmp_path, random_model_path):
    """``agentloop train`` with the verl switch spelled verl's way (``actor_rollout_ref.model.
    use_remove_padding=true``) and a token budget: the update's forwards run packed (through
    packed_sdpa_attention) and both steps train (a parity reward gives nonzero advantages).
    Gradient checkpointing turns off the update's prompt sharing, so the update packs even
    though the group's samples repeat a prompt (one process packs only where that computes
    fewer tokens: ``packing_pays``)."""
    import json
    import math

    from agentloop_trainer.cli import run_train
    from agentloop_trainer.config import load_config
    from agentloop_trainer.update.packed_attention import packed_attention_calls

    reward = tmp_path / "parity.py"
    reward.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                      "    return float(len(solution_str) % 2)\n")

    cfg = load_config([
        f"model.path={random_model_path}", "data.train_size=16", "data.val_size=2", "data.train_batch_size=2",
        "actor_rollout_ref.rollout.n=3", "actor_rollout_ref.rollout.multi_turn.max_tokens_per_turn=12",
        "data.max_response_length=40", "actor_rollout_ref.model.use_remove_padding=true",
        "actor_rollout_ref.model.enable_gradient_checkpointing=true",
        "actor_rollout_ref.actor.use_dynamic_bsz=true", "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=600",
        "trainer.total_steps=2", "trainer.test_freq=0", "trainer.save_freq=0", "trainer.progress_bar=false",
        "trainer.val_before_train=false", f"trainer.output_dir={tmp_path}", "trainer.experiment_name=packed",
        f"custom_reward_function.path={reward}", "actor_rollout_ref.actor.lr=5e-2",
    ])
    assert cfg.actor_rollout_ref.actor.use_remove_padding is True
    calls = packed_attention_calls()
    run_dir, summary = run_train(cfg, log=lambda *_: None)
    assert summary["steps"] == 2
    assert packed_attention_calls() > calls, "the update never ran a packed forward"
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in steps if "actor/pg_loss" in m]
    assert [m["step"] for m in steps] == [1, 2]
    assert all(math.isfinite(m["actor/pg_loss"]) and m["actor/grad_norm"] > 0 for m in steps)
    assert all(m["actor/micro_batches"] >= 1 for m in steps)
