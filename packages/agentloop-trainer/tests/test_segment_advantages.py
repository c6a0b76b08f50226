"""Trajectories split into segments: one advantage per trajectory, broadcast to its segments;
the loss counts a trajectory once whatever its segments; every segment reaches the update."""

from __future__ import annotations

import math

import pytest
import torch

from agentloop_core.batch import RolloutBatch
from agentloop_core.loop import AgentLoopBase
from agentloop_core.output import AgentLoopOutput
from agentloop_core.registry import register
from agentloop_core.segments import SegmentBuilder
from agentloop_trainer.update import (
    aggregate_loss,
    compute_advantages,
    policy_batch_from_rollout,
    ppo_clip_loss,
    response_log_probs,
    sequence_weights,
    trajectory_advantages,
)


def test_segments_of_a_trajectory_share_its_advantage_and_groups_count_trajectories():
    # trajectories 0,1,2 of group a (rewards 1, 0, 0); 0 and 2 have two segments each
    rewards = torch.tensor([1.0, 1.0, 0.0, 0.0, 0.0, 1.0, 0.0])
    groups = ["a", "a", "a", "a", "a", "b", "b"]
    trajectories = [0, 0, 1, 2, 2, 3, 4]
    adv = trajectory_advantages("grpo", rewards, groups, trajectories)
    # counted per segment the group would be (1, 1, 0, 0, 0): a different mean and std
    expected_a = compute_advantages("grpo", torch.tensor([1.0, 0.0, 0.0]), ["a"] * 3)
    expected_b = compute_advantages("grpo", torch.tensor([1.0, 0.0]), ["b"] * 2)
    torch.testing.assert_close(adv, torch.stack([expected_a[0], expected_a[0], expected_a[1], expected_a[2],
                                                 expected_a[2], expected_b[0], expected_b[1]]))
    assert float(adv[0]) == pytest.approx(2 / math.sqrt(3), abs=1e-5)
    # one row per trajectory: exactly the per-sample advantages
    flat = torch.tensor([1.0, 0.0, 0.0, 1.0])
    assert torch.equal(trajectory_advantages("dr_grpo", flat, [0, 0, 1, 1], [0, 1, 2, 3]),
                       compute_advantages("dr_grpo", flat, [0, 0, 1, 1]))
    with pytest.raises(ValueError, match="rows 0 and 1 of trajectory 0 have rewards 1.0/0.0"):
        trajectory_advantages("grpo", torch.tensor([1.0, 0.0]), ["a", "a"], [0, 0])
    with pytest.raises(ValueError, match="give one of each per row"):
        trajectory_advantages("grpo", torch.tensor([1.0, 0.0]), ["a"], [0, 1])


def test_a_split_trajectory_weighs_in_the_loss_as_the_unsplit_one():
    torch.manual_seed(0)
    per_token = torch.rand(3, 6)
    # trajectory 0 is 5 generated tokens in one row, or 2 + 3 split over two rows; trajectory 1 has 2
    whole_mask = torch.tensor([[1, 1, 1, 1, 1, 0], [1, 1, 0, 0, 0, 0]])
    whole = torch.stack([per_token[0], per_token[2]])
    split_tokens = torch.stack([per_token[0], per_token[0].roll(-2), per_token[2]])
    split_mask = torch.tensor([[1, 1, 0, 0, 0, 0], [1, 1, 1, 0, 0, 0], [1, 1, 0, 0, 0, 0]])
    weights = sequence_weights(split_mask, [7, 7, 9])
    torch.testing.assert_close(weights, torch.tensor([0.4, 0.6, 1.0]))
    for mode in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum"):
        torch.testing.assert_close(aggregate_loss(split_tokens, split_mask, mode, weights),
                                   aggregate_loss(whole, whole_mask, mode), msg=mode)
    # without the weights a seq-mean mode would count trajectory 0 twice
    assert not torch.isclose(aggregate_loss(split_tokens, split_mask, "seq-mean-token-mean"),
                             aggregate_loss(whole, whole_mask, "seq-mean-token-mean"))
    # a row with no generated tokens, or a trajectory with none, weighs nothing
    torch.testing.assert_close(sequence_weights(torch.tensor([[0, 0], [1, 0], [0, 0]]), [1, 1, 2]),
                               torch.tensor([0.0, 1.0, 0.0]))


def _segmented_batch() -> RolloutBatch:
    builder = SegmentBuilder()
    builder.add_call([5, 6, 7], [8, 9], [-1.0, -1.2])
    builder.add_call([5, 6, 7, 8, 9, 4], [10], [-0.7])
    builder.add_call([5, 11], [12, 13], [-0.9, -1.1])  # context rewritten: a second segment
    outs = builder.outputs(reward_score=1.0)
    for o in outs:
        o.trajectory_index = 0
    other = AgentLoopOutput([5, 6, 7], [14], [1], [-1.0], reward_score=0.0, trajectory_index=1)
    return RolloutBatch.from_outputs([*outs, other], pad_token_id=0)


def test_every_segment_row_reaches_the_policy_gradient(random_model_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(random_model_path)
    batch = _segmented_batch()
    pb = policy_batch_from_rollout(batch)
    assert pb.sequences[:2] == [[5, 6, 7, 8, 9, 4, 10], [5, 11, 12, 13]]
    torch.testing.assert_close(pb.seq_weights, torch.tensor([0.6, 0.4, 1.0]))
    adv = trajectory_advantages("grpo", torch.as_tensor(batch.rewards), ["g"] * 3, batch.trajectory_index.tolist())
    assert adv[0] == adv[1] > 0 > adv[2]
    logp = response_log_probs(model, pb).detach().requires_grad_(True)
    loss, _ = ppo_clip_loss(logp, logp.detach(), adv, pb.response_mask, loss_agg_mode="seq-mean-token-mean",
                            seq_weight=pb.seq_weights)
    loss.backward()
    # both segments of trajectory 0 push their generated tokens up, with one advantage
    for row in (0, 1):
        generated = pb.response_mask[row] == 1
        assert (logp.grad[row][generated] < 0).all()
        assert (logp.grad[row][~generated] == 0).all()
    padded = pb.padded(4)
    assert len(padded.sequences) == 4
    assert padded.response_mask[3].sum() == 0
    assert padded.seq_weights[3] == 0
    assert pb.padded(3) is pb
    # Rollout correction's sequences are trajectories: the two segments share one number.
    assert pb.trajectory_ids == [0, 0, 1]
    torch.testing.assert_close(padded.sequence_index(), torch.tensor([0, 0, 1, 2]))


SUMMARISING = "test_trainer_summarising"


@register(SUMMARISING)
class SummarisingLoop(AgentLoopBase):
    """Answers, then replaces its history with a one-line summary and answers again: two
    segments per trajectory. Its own reward is 1 for ``rollout_n == 0``, so every group has
    signal whatever the random policy writes."""

    async def run(self, sampling_params, **row):
        tok = self.tokenizer
        builder = SegmentBuilder()

        def render(messages):
            text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            return list(tok.encode(text, add_special_tokens=False))

        prompt = render(row["raw_prompt"])
        out = await self.server.generate(row["request_id"], prompt, sampling_params)
        builder.add_output(prompt, out)
        prompt = render([{"role": "user", "content": "Summary so far: none. Answer again."}])
        out = await self.server.generate(row["request_id"], prompt, sampling_params)
        builder.add_output(prompt, out)
        return builder.outputs(reward_score=float(row["rollout_n"] == 0), num_turns=2)


def test_grpo_step_broadcasts_the_trajectory_advantage_to_its_segments(tmp_path, random_model_path, tokenizer):
    from test_engine_sleep import _trainer
    from test_resume import _cfg

    cfg = _cfg(tmp_path, random_model_path, "segments", 1, **{
        "reward.source": "loop", "actor_rollout_ref.actor.loss_agg_mode": "seq-mean-token-mean"})
    trainer = _trainer(cfg, tokenizer)
    # the task's rows name the tool loop; these name the summarising one
    trainer.data.records = [{**r, "agent_name": SUMMARISING} for r in trainer.data.records]
    seen = {}
    update = trainer.actor.update

    def traced_update(pb, advantages, *args, **kwargs):
        seen.update(pb=pb, advantages=advantages.clone())
        return update(pb, advantages, *args, **kwargs)

    trainer.actor.update = traced_update
    try:
        metrics = trainer.train_step()
    finally:
        trainer.close()
    pb, adv = seen["pb"], seen["advantages"]
    # 2 prompts x 3 samples, 2 segments each: 12 rows, segment k of trajectory t at row 2t+k
    assert len(pb.sequences) == 12
    assert adv.shape == (12,)
    assert torch.equal(adv[0::2], adv[1::2])
    # per group [1, 0, 0] over its 3 trajectories, not over its 6 rows
    torch.testing.assert_close(adv[0::2], compute_advantages("grpo", torch.tensor([1.0, 0, 0] * 2), [0] * 3 + [1] * 3))
    assert (pb.response_mask.sum(-1) > 0).all(), "every segment row has generated tokens in the loss"
    torch.testing.assert_close(pb.seq_weights.view(6, 2).sum(-1), torch.ones(6))
    assert metrics["actor/grad_norm"] > 0
    assert math.isfinite(metrics["actor/pg_loss"])
    assert metrics["agent_loop/num_segments/mean"] == 2.0
    assert metrics["rollout/num_samples"] == 6
    assert metrics["reward/mean"] == pytest.approx(1 / 3)
    assert metrics["rollout/groups_with_signal"] == 1.0
