"""The trainer's recomputed log-probs equal the engine's (HFServer) on the same weights, and the
shared-prefix forward equals a plain forward."""

from __future__ import annotations

import random

import pytest
import torch

from agentloop_trainer.config import load_config
from agentloop_trainer.rollout import make_rows
from agentloop_trainer.stages.rollout_setup import rollout_fleet
from agentloop_trainer.task import BIASED_TEMPLATES, dataset_row, make_problems
from agentloop_trainer.update import (
    common_prefix_length,
    policy_batch_from_rollout,
    response_log_probs,
    sequence_log_probs,
)


@pytest.fixture(scope="module")
def model(random_model_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(random_model_path))


def test_shared_prefix_forward_equals_plain_forward(model, tokenizer):
    from agentloop_trainer.stages.sft import demonstration_batch

    examples = demonstration_batch(tokenizer, make_problems(6, 3), random.Random(0), 0.6, BIASED_TEMPLATES)
    seqs = [e.input_ids for e in examples]
    assert common_prefix_length(seqs) > 100  # system turn + tool schema
    shared = sequence_log_probs(model, seqs, share_prefix=True)
    plain = sequence_log_probs(model, seqs, share_prefix=False)
    assert torch.allclose(shared, plain, atol=1e-5)
    g = []
    for flag in (True, False):
        model.zero_grad()
        sequence_log_probs(model, seqs, share_prefix=flag).sum().backward()
        g.append(model.model.embed_tokens.weight.grad.clone())
    assert torch.allclose(g[0], g[1], atol=1e-4)


@pytest.mark.parametrize("share_prefix", [True, False])
@pytest.mark.parametrize("where", ["inside_prefix", "at_prefix_end", "in_tail"])
def test_scoring_from_a_later_token_gives_the_same_values_there(model, tokenizer, share_prefix, where):
    from agentloop_trainer.stages.sft import demonstration_batch

    examples = demonstration_batch(tokenizer, make_problems(5, 4), random.Random(1), 0.6, BIASED_TEMPLATES)
    seqs = [e.input_ids for e in examples]
    P = common_prefix_length(seqs)
    first = {"inside_prefix": P - 20, "at_prefix_end": P, "in_tail": P + 15}[where]
    full = sequence_log_probs(model, seqs, share_prefix=share_prefix)
    part = sequence_log_probs(model, seqs, share_prefix=share_prefix, first_scored=first)
    assert part.shape == full.shape
    assert torch.allclose(part[:, first - 1 :], full[:, first - 1 :], atol=1e-5)
    assert (part[:, : first - 1] == 0).all()


def test_recomputed_log_probs_match_hfserver(model, tokenizer):
    import copy

    cfg = load_config(["actor_rollout_ref.rollout.multi_turn.max_tokens_per_turn=12", "data.max_response_length=40",
                       "actor_rollout_ref.rollout.temperature=1.0", "trainer.seed=3"])
    engine = rollout_fleet(cfg, "unused: the engine serves the in-memory copy", tokenizer, copy.deepcopy(model))
    try:
        records = [dataset_row(p, "test") for p in make_problems(2, 5)]
        batch = engine.generate(make_rows(records, 3))
    finally:
        engine.close()
    pb = policy_batch_from_rollout(batch)
    assert pb.response_mask.sum() > 0
    with torch.no_grad():
        recomputed = response_log_probs(model, pb)
    mask = pb.response_mask.bool()
    diff = (recomputed - pb.rollout_log_probs).abs()[mask]
    assert float(diff.max()) < 1e-4, f"max |trainer - engine| log-prob gap {float(diff.max())}"
    # tokens the engine did not generate carry no log-prob at all
    assert torch.all(pb.rollout_log_probs[~mask] == 0)
