"""DAPO's config sections, under verl's keys: dynamic sampling
(``algorithm.filter_groups``) and over-long reward shaping (``reward_model.overlong_buffer``).
What they do: :mod:`agentloop_trainer.rollout.dynamic_sampling`."""

from __future__ import annotations

from dataclasses import dataclass, field

FILTER_METRICS: tuple[str, ...] = ("acc", "score", "seq_reward", "seq_final_reward")
"""Values of ``algorithm.filter_groups.metric``: per-trajectory quantities a group's spread is
measured on (:func:`agentloop_trainer.rollout.dynamic_sampling.trajectory_metric`)."""

ON_LIMIT: tuple[str, ...] = ("error", "train_kept")
"""Values of ``algorithm.filter_groups.on_limit``."""


@dataclass
class FilterGroupsSection:
    """Dynamic sampling (DAPO; verl: ``algorithm.filter_groups``): a GRPO group whose samples all
    have the same ``metric`` teaches nothing (every advantage is 0), so it is dropped and more
    prompts are rolled out until ``data.train_batch_size`` groups with a spread are kept."""

    enable: bool = False
    """Drop all-equal groups and draw more prompt batches to fill the step."""
    metric: str = "acc"
    """What must differ within a group: acc (the reward function's ``acc`` when it returns one,
    else the reward before over-long shaping) | score (the reward before over-long shaping) |
    seq_reward | seq_final_reward (the reward after it; the same here, as agentloop puts no KL
    in the reward)."""
    max_num_gen_batches: int = 0
    """Most prompt batches (of ``data.train_batch_size`` prompts) rolled out for one step; 0: no
    limit (verl's meaning: draw until the step is full, however long that takes)."""
    on_limit: str = "error"
    """What a sync step does when ``max_num_gen_batches`` batches kept too few groups: error (as
    verl: stop the run, naming the counts) | train_kept (train on the groups kept, fewer than
    ``data.train_batch_size``, with a warning). agentloop's key; asynchronous modes: error only."""


@dataclass
class OverlongBufferSection:
    """Over-long reward shaping (DAPO; verl: ``reward_model.overlong_buffer``): a response longer
    than ``data.max_response_length - len`` tokens gets ``-min(1, over / len) * penalty_factor``
    added to its reward, ``over`` being how far it passes that point."""

    enable: bool = False
    """Shape the rewards of over-long responses."""
    len: int = 0
    """The buffer: how many tokens before ``data.max_response_length`` the penalty starts
    (between 1 and ``data.max_response_length - 1`` when enabled)."""
    penalty_factor: float = 1.0
    """The penalty of a response that fills ``data.max_response_length`` (DAPO's 1.0)."""


@dataclass
class RewardModelSection:
    """verl's ``reward_model`` keys that agentloop reads (``reward_model.enable`` and
    ``reward_model.reward_manager`` are accepted and ignored)."""

    overlong_buffer: OverlongBufferSection = field(default_factory=OverlongBufferSection)
    """Over-long reward shaping."""
