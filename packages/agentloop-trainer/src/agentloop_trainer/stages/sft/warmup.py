"""The tiny model's SFT warm-up: the general SFT step on the (biased) teacher's demonstrations,
drawn afresh each step, under one of the warm-up's learning-rate schedules
(:mod:`~agentloop_trainer.policy.lr_schedules`).

Tokenization and loss are the general stage's (:mod:`~agentloop_trainer.stages.sft.tokenize`,
:func:`~agentloop_trainer.stages.sft.loss.sft_step`); only the schedule and the demonstration stream
are the warm-up's own.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from typing import Any

from agentloop_trainer.policy.lr_schedules import (
    STOP_WINDOW,
    WarmupSchedule,
    learned,
    make_schedule,
    window_mean,
)
from agentloop_trainer.policy.settings import SFTSection
from agentloop_trainer.stages.sft.loss import make_optimizer, sft_step
from agentloop_trainer.stages.sft.tokenize import TokenizedConversation, shared_tokenizer
from agentloop_trainer.task.calculator import Problem, demonstration, tool_schemas

__all__ = ["STOP_WINDOW", "SFTConfig", "demonstration_batch", "learned", "make_schedule", "train_sft", "window_mean"]


def demonstration_batch(tokenizer: Any, problems: Sequence[Problem], rng: random.Random,
                        flip_prob: float, biased_templates: tuple[int, ...],
                        check_prefix: bool = True) -> list[TokenizedConversation]:
    """Tokenized teacher demonstrations for ``problems`` (all of one shape: system, user,
    tool call, tool result, answer; ``check_prefix`` applies to the first only)."""
    tools = tool_schemas()
    sft = shared_tokenizer(tokenizer)
    return [
        sft.tokenize(demonstration(p, rng, flip_prob, biased_templates), tools, check=check_prefix and k == 0)
        for k, p in enumerate(problems)
    ]


SFTConfig = SFTSection
"""The old name of the warm-up's settings, which are the ``sft`` section itself
(:class:`~agentloop_trainer.policy.settings.SFTSection`); deprecated 2026-12-05, removed in 0.7.0."""


def train_sft(model: Any, tokenizer: Any, problems: Sequence[Problem], config: SFTSection,
              biased_templates: tuple[int, ...], progress: Callable[[int, float], None] | None = None,
              schedule: WarmupSchedule | None = None) -> list[float]:
    """Train ``model`` in place on teacher demonstrations of ``problems``.

    Runs the learning-rate schedule ``config.schedule`` (:func:`make_schedule`) until it says
    stop: ``cosine_restarts`` repeats a ``config.steps``-step cosine schedule while the
    demonstrations are not learned (:func:`learned` with ``config.stop_loss``); ``wsd`` holds the
    peak rate until the loss leaves its plateau, then decays and stops once learned. A caller
    that reports on the schedule (its plan, its outcome) builds it and passes it as ``schedule``.

    Returns:
        The loss of every step run.
    """
    rng = random.Random(config.seed)
    opt = make_optimizer(model, config.lr, config.weight_decay)
    schedule = make_schedule(config) if schedule is None else schedule
    model.train()
    while not schedule.done():
        step = len(schedule.losses)
        chosen = [problems[rng.randrange(len(problems))] for _ in range(config.batch_size)]
        # The demonstrations' template rendering is checked on the first step (one shape for all).
        examples = demonstration_batch(tokenizer, chosen, rng, config.flip_prob, biased_templates,
                                       check_prefix=step == 0)
        out = sft_step(model, opt, examples, schedule.lr(),
                       micro_batch_size=config.micro_batch_size, grad_clip=config.grad_clip)
        schedule.record(out["loss"])
        if progress is not None:
            progress(step, out["loss"])
    model.eval()
    return list(schedule.losses)
