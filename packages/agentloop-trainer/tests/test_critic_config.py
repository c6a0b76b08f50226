"""The critic's config (config/critic.py): asked for only with ``algorithm.adv_estimator=gae``,
read under verl's spellings, and refused with the key named where it cannot work."""

from __future__ import annotations

import pytest

from agentloop_trainer.config import ConfigError, load_config
from agentloop_trainer.update.advantages import ADVANTAGE_ESTIMATORS

GAE = ["algorithm.adv_estimator=gae", "critic.optim.lr=1e-4"]


def test_gae_without_a_critic_learning_rate_names_the_key():
    with pytest.raises(ConfigError, match=r"critic\.optim\.lr must be set to a learning rate > 0 with "
                                          r"algorithm\.adv_estimator=gae .*critic\.optim\.lr=1e-4"):
        load_config(["algorithm.adv_estimator=gae"])


def test_the_critic_keys_are_not_asked_for_without_a_critic():
    cfg = load_config(["algorithm.adv_estimator=grpo"])
    assert cfg.critic.optim.lr is None


def test_gae_is_in_the_table_and_needs_a_critic_but_no_group():
    record = ADVANTAGE_ESTIMATORS.get("gae")
    assert record.needs_critic
    assert (record.min_group_size, record.verl_name) == (1, "gae")
    cfg = load_config([*GAE, "actor_rollout_ref.rollout.n=1"])
    assert cfg.actor_rollout_ref.rollout.n == 1


def test_verl_spellings_are_read(capsys):
    """A verl PPO command line's critic and GAE keys: each lands on its field, and verl's
    memory knobs for the critic are accepted with a notice."""
    cfg = load_config([*GAE, "algorithm.gamma=0.99", "algorithm.lam=0.95", "critic.ppo_epochs=2",
                       "critic.cliprange_value=0.2", "critic.ppo_mini_batch_size=4",
                       "critic.ppo_micro_batch_size_per_gpu=8", "critic.model.path=/models/critic",
                       "critic.optim.weight_decay=0.0", "trainer.critic_warmup=3", "critic.grad_clip=0.5",
                       "critic.strategy=fsdp", "critic.model.fsdp_config.param_offload=false",
                       "critic.loss_agg_mode=token-mean"])
    c = cfg.critic
    assert (cfg.algorithm.gamma, cfg.algorithm.lam, cfg.trainer.critic_warmup) == (0.99, 0.95, 3)
    assert (c.optim.lr, c.optim.weight_decay, c.ppo_epochs, c.cliprange_value) == (1e-4, 0.0, 2, 0.2)
    assert (c.ppo_mini_batch_size, c.ppo_micro_batch_size_per_gpu, c.model.path, c.grad_clip) == (
        4, 8, "/models/critic", 0.5)
    captured = capsys.readouterr()
    assert "verl key critic.strategy ignored" in captured.out + captured.err


def test_a_misspelt_critic_key_is_an_error_not_ignored():
    with pytest.raises(ConfigError, match=r"critic\.cliprange_valu"):
        load_config([*GAE, "critic.cliprange_valu=0.2"])


@pytest.mark.parametrize(("override", "key"), [
    ("algorithm.gamma=1.5", "algorithm.gamma"),
    ("algorithm.lam=-0.1", "algorithm.lam"),
    ("critic.cliprange_value=0", "critic.cliprange_value"),
    ("critic.ppo_epochs=0", "critic.ppo_epochs"),
    ("algorithm.turn_credit=discounted", "algorithm.turn_credit"),
    ("trainer.critic_warmup=-1", "trainer.critic_warmup"),
    ("critic.loss_agg_mode=seq-mean-token-mean", "critic.loss_agg_mode"),
])
def test_values_gae_cannot_use_are_refused_naming_the_key(override, key):
    with pytest.raises((ConfigError, ValueError), match=key.replace(".", r"\.")):
        load_config([*GAE, "actor_rollout_ref.rollout.n=2", override])


def test_gae_loads_with_several_fsdp_ranks():
    """The critic is sharded like the policy (test_critic_fsdp.py), so gae on FSDP ranks loads."""
    cfg = load_config([*GAE, "trainer.fsdp_ranks=2", "data.train_batch_size=2", "actor_rollout_ref.rollout.n=2"])
    assert (cfg.trainer.fsdp_ranks, cfg.algorithm.adv_estimator) == (2, "gae")
