"""A failed rollout sample (no tokens at all) is masked out of the update, never a crash."""

from __future__ import annotations

import torch

from agentloop_core.batch import RolloutBatch
from agentloop_core.output import AgentLoopOutput
from agentloop_trainer.actor import policy_batch_from_rollout, response_log_probs


def test_empty_failed_sample_is_masked_not_fatal(random_model_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(random_model_path)
    ok = AgentLoopOutput(prompt_ids=[5, 6, 7], response_ids=[8, 9], response_mask=[1, 1], response_logprobs=[-1.0, -1.0])
    failed = AgentLoopOutput.failure(None, RuntimeError("engine died"))
    pb = policy_batch_from_rollout(RolloutBatch.from_outputs([ok, failed], pad_token_id=0))
    assert pb.sequences[1] == [] and pb.response_mask[1].sum() == 0
    logp = response_log_probs(model, pb)
    assert logp.shape == pb.response_mask.shape
    assert torch.isfinite(logp).all()
    alone = response_log_probs(model, policy_batch_from_rollout(RolloutBatch.from_outputs([ok], pad_token_id=0)))
    torch.testing.assert_close(logp[0, :2], alone[0, :2], atol=1e-5, rtol=0)
