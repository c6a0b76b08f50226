"""A failed rollout sample (no tokens at all) is masked out of the update, never a crash."""

from __future__ import annotations

import torch

from agentloop_core.batch import RolloutBatch
from agentloop_core.output import AgentLoopOutput
from agentloop_trainer.update import policy_batch_from_rollout, response_log_probs


def test_empty_failed_sample_is_masked_not_fatal(random_model_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(random_model_path)
    ok = AgentLoopOutput(prompt_ids=[5, 6, 7], response_ids=[8, 9], response_mask=[1, 1], response_logprobs=[-1.0, -1.0])
    failed = AgentLoopOutput.failure(None, RuntimeError("engine died"))
    pb = policy_batch_from_rollout(RolloutBatch.from_outputs([ok, failed], pad_token_id=0))
    assert pb.sequences[1] == []
    assert pb.response_mask[1].sum() == 0
    logp = response_log_probs(model, pb)
    assert logp.shape == pb.response_mask.shape
    assert torch.isfinite(logp).all()
    alone = response_log_probs(model, policy_batch_from_rollout(RolloutBatch.from_outputs([ok], pad_token_id=0)))
    torch.testing.assert_close(logp[0, :2], alone[0, :2], atol=1e-5, rtol=0)


def test_agentloop_rollout_writes_tokens_masks_and_per_sample_metrics(random_model_path, tmp_path):
    """``agentloop rollout``'s records: the engine's token ids with their mask and log-probs, the
    reward, and each trajectory's metrics (tool counters and timings) for inspection."""
    import json

    from agentloop_trainer.cli import write_rollouts
    from agentloop_trainer.config import load_config

    cfg = load_config([
        "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.rollout.multi_turn.max_tokens_per_turn=12",
        "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=2", "data.max_response_length=40",
        "data.train_size=16", "data.val_size=4",
    ])
    out = write_rollouts(cfg, random_model_path, tmp_path / "r.jsonl", num_prompts=3)
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(records) == 6
    assert [r["rollout_n"] for r in records] == [0, 1] * 3
    for r in records:
        assert len(r["response_ids"]) == len(r["response_mask"]) == len(r["rollout_log_probs"]) > 0
        assert r["metrics"]["assistant_turns"] >= 1
        assert r["metrics"]["generate_s"] > 0
        assert "tool_calls" in r["metrics"]
        assert isinstance(r["reported_metrics"], list)
