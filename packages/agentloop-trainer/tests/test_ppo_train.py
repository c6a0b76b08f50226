"""`agentloop train algorithm.adv_estimator=gae` end to end on a small random policy: the critic
trains beside the policy (finite critic metrics), ``trainer.critic_warmup`` holds the policy
still, and a resumed run gets the critic's weights and optimizer back."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from agentloop_trainer.update.critic import CRITIC_FILE

CRITIC_METRICS = ("critic/vf_loss", "critic/vf_clipfrac", "critic/values_mean", "critic/vf_explained_var")


def _args(tmp_path: Path, model_path: Path, *extra: str) -> list[str]:
    reward = tmp_path / "parity.py"  # a random policy never answers: score the length's parity
    reward.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                      "    return float(len(solution_str) % 2)\n")
    return [f"model.path={model_path}", f"trainer.run_dir={tmp_path / 'run'}", "trainer.test_freq=0",
            "trainer.val_before_train=false", "trainer.progress_bar=false", "data.train_size=8", "data.val_size=2",
            "data.train_batch_size=2", "actor_rollout_ref.rollout.n=2",
            "actor_rollout_ref.rollout.multi_turn.max_tokens_per_turn=8", "data.max_response_length=16",
            f"custom_reward_function.path={reward}", "algorithm.adv_estimator=gae", "critic.optim.lr=1e-3",
            "algorithm.gamma=0.9", "algorithm.lam=0.8", "trainer.save_hf=false", *extra]


def _steps(run: Path) -> list[dict]:
    return [s for s in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "reward/mean" in s]


@pytest.mark.slow
def test_two_ppo_steps_train_the_critic_and_warmup_holds_the_policy(tmp_path, random_model_path):
    """Two steps with ``trainer.critic_warmup=1``: both steps log finite critic metrics (verl's
    names) and update the critic; only the second updates the policy. If this fails, read the
    run's metrics.jsonl: a missing ``critic/*`` key means the trainer did not build the critic
    (stages/ppo.py), a NaN one a broken value forward or GAE (update/critic.py, update/gae.py)."""
    from agentloop_trainer.cli import main

    args = _args(tmp_path, random_model_path, "trainer.total_steps=2", "trainer.critic_warmup=1",
                 "trainer.save_freq=2")
    assert main(["train", *args]) == 0
    steps = _steps(tmp_path / "run")
    assert [s["step"] for s in steps] == [1, 2]
    for s in steps:
        for key in CRITIC_METRICS:
            assert math.isfinite(s[key]), (key, s[key])
        assert s["critic/num_updates"] == 1.0
    assert "actor/pg_loss" not in steps[0]  # the warm-up step trains only the critic
    assert math.isfinite(steps[1]["actor/pg_loss"])
    assert (tmp_path / "run" / "checkpoints" / "step_2" / CRITIC_FILE).is_file()


@pytest.mark.slow
def test_resume_restores_the_critics_weights_and_optimizer(tmp_path, random_model_path):
    """A run saved at step 1 and resumed loads ``critic.pt`` into the new trainer's critic: its
    weights and AdamW state equal the saved ones, not a fresh value head's."""
    from agentloop_trainer.config import load_config
    from agentloop_trainer.stages.build import build_trainer

    args = _args(tmp_path, random_model_path, "trainer.total_steps=1", "trainer.save_freq=1")
    from agentloop_trainer.cli import main

    assert main(["train", *args]) == 0
    saved = torch.load(tmp_path / "run" / "checkpoints" / "step_1" / CRITIC_FILE, weights_only=True)
    cfg = load_config([*args, "trainer.resume=must"])
    trainer = build_trainer(cfg, random_model_path, tmp_path / "run")
    try:
        fresh = trainer.critic.model.value_head.weight.detach().clone()
        assert not torch.equal(fresh, saved["model"]["value_head.weight"])
        assert trainer.resume()
        for name, value in trainer.critic.model.state_dict().items():
            assert torch.equal(value, saved["model"][name]), name
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        # critic.pt keys the AdamW state by parameter name, so any number of ranks can load it.
        full: Any = get_optimizer_state_dict(trainer.critic.model, trainer.critic.optimizer,
                                             options=StateDictOptions(full_state_dict=True))
        state = full["state"]
        assert state
        assert set(state) == set(saved["optimizer"]["state"])
        assert all(torch.equal(v["exp_avg"], saved["optimizer"]["state"][k]["exp_avg"]) for k, v in state.items())
    finally:
        trainer.close()


@pytest.mark.slow
def test_ppo_on_two_fsdp_ranks_trains_and_checkpoints_the_sharded_critic(tmp_path, random_model_path):
    """``agentloop train algorithm.adv_estimator=gae trainer.fsdp_ranks=2``: both ranks hold a
    shard of the critic, the steps log finite critic metrics, and the checkpoint's ``critic.pt``
    holds the full (gathered) weights. That two ranks compute what one does is
    test_critic_fsdp.py's; a hang here points at a collective one rank skipped."""
    from agentloop_trainer.cli import main

    args = _args(tmp_path, random_model_path, "trainer.total_steps=2", "trainer.critic_warmup=1",
                 "trainer.save_freq=2", "trainer.fsdp_ranks=2")
    assert main(["train", *args]) == 0
    steps = _steps(tmp_path / "run")
    assert [s["step"] for s in steps] == [1, 2]
    for s in steps:
        for key in CRITIC_METRICS:
            assert math.isfinite(s[key]), (key, s[key])
    assert "actor/pg_loss" not in steps[0]
    saved = torch.load(tmp_path / "run" / "checkpoints" / "step_2" / CRITIC_FILE, weights_only=True)
    head = saved["model"]["value_head.weight"]
    assert head.shape[0] == 1
    assert head.shape[1] > 1  # whole, not one rank's shard
    assert saved["optimizer"]["state"]
