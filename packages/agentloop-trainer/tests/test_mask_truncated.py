"""``algorithm.mask_truncated``: trajectories cut short by a length limit leave the policy loss
(an all-zero mask, as a failed sample's), the others keep theirs."""

from __future__ import annotations

import torch

from agentloop_core.batch import RolloutBatch
from agentloop_core.output import AgentLoopOutput
from agentloop_core.stops import StopCounter
from agentloop_trainer.config import load_config
from agentloop_trainer.update import policy_batch_from_rollout


def _batch() -> RolloutBatch:
    capped, clean = StopCounter(), StopCounter()
    capped.add("stop", 30, 48, 48)  # a tool call that ended
    capped.add("length", 48, 48, 48)  # an answer that ran into the per-turn cap
    clean.add("stop", 30, 48, 48)
    clean.add("stop", 5, 48, 48)
    outputs = [AgentLoopOutput(prompt_ids=[1, 2], response_ids=[3, 4, 5, 6], response_mask=[1, 0, 1, 1],
                               reward_score=1.0, metrics=counter.metrics()) for counter in (capped, clean)]
    return RolloutBatch.from_outputs(outputs, pad_token_id=0)


def test_a_trajectory_cut_by_the_turn_cap_leaves_the_loss_only_when_asked():
    kept = policy_batch_from_rollout(_batch())
    masked = policy_batch_from_rollout(_batch(), mask_truncated=True)
    assert kept.response_mask.tolist() == [[1, 0, 1, 1], [1, 0, 1, 1]]
    assert masked.response_mask.tolist() == [[0, 0, 0, 0], [1, 0, 1, 1]]
    assert torch.equal(torch.tensor(masked.sequences[0]), torch.tensor(kept.sequences[0]))  # still rolled out


def test_the_key_is_read_and_off_by_default():
    assert load_config([]).algorithm.mask_truncated is False
    assert load_config(["algorithm.mask_truncated=true"]).algorithm.mask_truncated is True
