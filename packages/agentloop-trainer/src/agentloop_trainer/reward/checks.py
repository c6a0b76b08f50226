"""The checks of the reward's sections (:mod:`agentloop_trainer.reward.settings`): ranges and
choices, and the judge's settings resolved once (:meth:`~agentloop_trainer.reward.judge.JudgeSettings.from_section`)."""

from __future__ import annotations

import math

from agentloop_trainer.config_base import ConfigError, require
from agentloop_trainer.reward.judge import POLICY, JudgeSettings
from agentloop_trainer.reward.scoring import ANSWER_FORMATS
from agentloop_trainer.reward.settings import REWARD_SOURCES, JudgeSection, RewardModelSection, RewardSection


def check(reward: RewardSection, reward_model: RewardModelSection, *, rollout_n: int, on_ray: bool,
          response_length: int) -> None:
    """Range and choice checks of ``reward`` (its judge included) and ``reward_model``, given
    ``rollout.n``, whether the rollout runs on Ray and ``data.max_response_length``.

    Raises:
        ConfigError: naming the key and what it must be.
    """
    ob = reward_model.overlong_buffer
    require([
        ("reward.source", reward.source in REWARD_SOURCES, f"one of {REWARD_SOURCES}"),
        ("reward.timeout_s", reward.timeout_s is None or reward.timeout_s > 0,
         "null (no limit) or a positive number of seconds"),
        ("reward.answer_format", all(v in ANSWER_FORMATS for v in reward.answer_format.values()),
         f"a mapping of data_source (or default) to one of {ANSWER_FORMATS}, e.g. reward.answer_format.gsm8k=flexible"),
        ("reward_model.overlong_buffer.len", not ob.enable or 1 <= ob.len < response_length,
         f"between 1 and data.max_response_length - 1 ({response_length - 1}) with "
         f"reward_model.overlong_buffer.enable=true, got {ob.len}"),
        ("reward_model.overlong_buffer.penalty_factor", math.isfinite(ob.penalty_factor) and ob.penalty_factor >= 0,
         f"a finite number >= 0, got {ob.penalty_factor}"),
    ])
    _check_judge(reward.judge, rollout_n=rollout_n, on_ray=on_ray)


def _check_judge(judge: JudgeSection, *, rollout_n: int, on_ray: bool) -> None:
    """``reward.judge`` (:meth:`~agentloop_trainer.reward.judge.JudgeSettings.from_section`), and
    that ``url=policy`` has the policy engine in the trainer's process."""
    try:
        settings = JudgeSettings.from_section(judge)
    except ValueError as exc:
        raise ConfigError(f"config {exc}") from None
    if settings is not None and settings.url == POLICY and on_ray:
        raise ConfigError("config reward.judge.url=policy needs the inprocess rollout backend (the judge calls the "
                          "engine from the rollout workers of the trainer's process); on Ray serve a judge "
                          "(`agentloop serve CHECKPOINT --port 8001`) and set reward.judge.url=http://HOST:8001/v1")
    if settings is not None and settings.mode == "group" and rollout_n < 2:
        raise ConfigError(f"config reward.judge.mode=group compares the samples of a prompt, but "
                          f"actor_rollout_ref.rollout.n={rollout_n}: set n to 2 or more, "
                          "or reward.judge.mode=single")
