"""The critic itself (update/critic.py) on a small random policy: values land on the response
positions, its update fits the returns, and with LoRA it trains only its own adapter and head."""

from __future__ import annotations

import pytest
import torch

from agentloop_trainer.config import load_config
from agentloop_trainer.stages.ppo import build_critic
from agentloop_trainer.update.actor import PolicyBatch
from agentloop_trainer.update.critic import ScoredBatch


def _batch() -> PolicyBatch:
    """Two rows: prompt 3 tokens + response 4 (the third a tool token), and prompt 2 + response 2."""
    mask = torch.tensor([[1.0, 1.0, 0.0, 1.0], [1.0, 1.0, 0.0, 0.0]])
    return PolicyBatch(sequences=[[5, 6, 7, 10, 11, 12, 13], [5, 6, 20, 21]], prompt_lengths=[3, 2],
                       response_mask=mask, rollout_log_probs=None)


def _critic(model_path, *extra: str):
    cfg = load_config([f"model.path={model_path}", "algorithm.adv_estimator=gae", "critic.optim.lr=1e-2",
                       "critic.cliprange_value=10", "actor_rollout_ref.rollout.n=1", *extra])
    return build_critic(cfg, model_path)


def test_values_sit_on_the_response_positions(random_model_path):
    """Row 1's value at response token j is the head on the hidden state at prompt_length + j - 1:
    the same row alone, or run with a longer row beside it (right padding), gives the same values."""
    critic = _critic(random_model_path)
    pb = _batch()
    both = critic.compute_values(pb)
    alone = critic.compute_values(PolicyBatch([pb.sequences[1]], [2], pb.response_mask[1:], None))
    torch.testing.assert_close(both[1:], alone, atol=1e-5, rtol=1e-5)
    assert both[1, 2:].abs().sum() == 0  # padding
    assert both[0, 2] == 0  # the tool token is masked
    with torch.no_grad():
        hidden = critic.model.trunk()(input_ids=torch.tensor([pb.sequences[1]])).last_hidden_state
        expected = critic.model.value_head(hidden).squeeze(-1)[0, 1:3]
    torch.testing.assert_close(both[1, :2], expected, atol=1e-5, rtol=1e-5)


def test_the_update_fits_the_returns(random_model_path):
    """Ten updates towards fixed returns (1 on row 0, -1 on row 1) shrink the value loss."""
    critic = _critic(random_model_path)
    pb = _batch()
    values = critic.compute_values(pb)
    returns = torch.tensor([[1.0, 1.0, 0.0, 1.0], [-1.0, -1.0, 0.0, 0.0]])
    first = last = critic.update(pb, ScoredBatch(torch.zeros_like(values), values, returns))
    for _ in range(10):
        last = critic.update(pb, ScoredBatch(torch.zeros_like(values), critic.compute_values(pb), returns))
    assert last["critic/vf_loss"] < first["critic/vf_loss"] / 2
    assert last["critic/num_updates"] == 1.0


def test_score_refuses_a_trajectory_split_into_rows(random_model_path):
    critic = _critic(random_model_path)
    pb = _batch()
    pb.trajectory_ids = [0, 0]
    with pytest.raises(ValueError, match="needs each trajectory in one row"):
        critic.score(pb, torch.tensor([1.0, 1.0]))


def test_score_refuses_rows_with_images(random_model_path):
    critic = _critic(random_model_path)
    pb = _batch()
    pb.images = [("an image",), ()]
    with pytest.raises(ValueError, match="does not score rows with images"):
        critic.score(pb, torch.tensor([1.0, 1.0]))


def test_with_lora_the_critic_trains_its_own_adapter_and_head(random_model_path):
    pytest.importorskip("peft", reason="model.lora_rank needs peft (agentloop-trainer[lora])")
    critic = _critic(random_model_path, "model.lora_rank=4", "model.lora_alpha=8")
    names = {n for n, p in critic.model.named_parameters() if p.requires_grad}
    assert names
    assert all("lora_" in n or n.startswith("value_head.") for n in names), sorted(names)
    assert {"value_head.weight", "value_head.bias"} <= names
    base = {n: p.detach().clone() for n, p in critic.model.named_parameters() if not p.requires_grad}
    pb = _batch()
    values = critic.compute_values(pb)
    critic.update(pb, ScoredBatch(torch.zeros_like(values), values, torch.ones_like(values) * pb.response_mask))
    assert all(torch.equal(p, base[n]) for n, p in critic.model.named_parameters() if n in base)
