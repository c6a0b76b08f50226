"""The tiny model's SFT warm-up: the general SFT step on the (biased) teacher's demonstrations,
drawn afresh each step, with the warm-restart schedule the main job was calibrated with.

Tokenization and loss are the general stage's (:mod:`~agentloop_trainer.stages.sft.tokenize`,
:func:`~agentloop_trainer.stages.sft.loss.sft_step`); only the schedule and the demonstration stream
are the warm-up's own.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from typing import Any

from agentloop_trainer.policy.settings import SFTSection
from agentloop_trainer.stages.sft.loss import cosine_lr, make_optimizer, sft_step
from agentloop_trainer.stages.sft.tokenize import TokenizedConversation, shared_tokenizer
from agentloop_trainer.task.calculator import Problem, demonstration, tool_schemas


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


STOP_WINDOW = 50
"""Last steps of a schedule whose mean loss is compared with ``SFTSection.stop_loss``."""


def window_mean(losses: Sequence[float]) -> float:
    """Mean loss of the last :data:`STOP_WINDOW` steps (nan before any step)."""
    tail = losses[-STOP_WINDOW:]
    return sum(tail) / len(tail) if tail else math.nan


def learned(losses: Sequence[float], stop_loss: float | None) -> bool:
    """Whether the mean loss of the last :data:`STOP_WINDOW` steps is below ``stop_loss``
    (None: the warm-up never repeats, so it counts as learned)."""
    return stop_loss is None or (bool(losses) and window_mean(losses) < stop_loss)


def train_sft(model: Any, tokenizer: Any, problems: Sequence[Problem], config: SFTSection,
              biased_templates: tuple[int, ...], progress: Callable[[int, float], None] | None = None) -> list[float]:
    """Train ``model`` in place on teacher demonstrations of ``problems``.

    Runs the learning-rate schedule (``config.steps`` steps: linear warm-up, cosine decay), and
    runs it again from the start (a warm restart) while the demonstrations are not learned
    (:func:`learned` with ``config.stop_loss``) and another run fits in ``config.max_steps``.

    Returns:
        The loss of every step run.
    """
    rng = random.Random(config.seed)
    opt = make_optimizer(model, config.lr, config.weight_decay)
    model.train()
    losses: list[float] = []
    budget = max(config.steps, config.max_steps or 0)
    while True:
        for k in range(config.steps):
            step = len(losses)
            chosen = [problems[rng.randrange(len(problems))] for _ in range(config.batch_size)]
            # The demonstrations' template rendering is checked on the first step (one shape for all).
            examples = demonstration_batch(tokenizer, chosen, rng, config.flip_prob, biased_templates,
                                           check_prefix=step == 0)
            out = sft_step(model, opt, examples, cosine_lr(k, config.steps, config.lr, config.warmup_steps),
                           micro_batch_size=config.micro_batch_size, grad_clip=config.grad_clip)
            losses.append(out["loss"])
            if progress is not None:
                progress(step, losses[-1])
        if learned(losses, config.stop_loss) or len(losses) + config.steps > budget:
            break
    model.eval()
    return losses
