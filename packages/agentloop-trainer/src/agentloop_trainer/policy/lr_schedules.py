"""The SFT learning-rate schedules: :func:`cosine_lr` (the general stage's), and the tiny warm-up's
schedules (``sft.schedule``, :data:`SCHEDULES`), as pure policies fed one loss at a time.

The warm-up's loss sits on a plateau (~0.2-0.5) for a number of steps that is chaotic (it moves
several-fold with the seed, the thread count, the CPU's float rounding), then falls within a few
dozen steps. A schedule fixed in advance is therefore wrong for most runs:

- :class:`CosineRestarts` (the calibrated original): ``steps`` steps of linear warm-up and cosine
  decay, run again from the start while the demonstrations are not learned. A plateau that ends
  late meets a learning rate already low, and a run that misses ``stop_loss`` by a little pays a
  whole schedule more.
- :class:`PlateauExitSchedule` (warmup-stable-decay keyed to the plateau's exit): hold the peak
  rate while the loss is on the plateau, start a fixed cooldown when the loss leaves it, and stop
  as soon as the demonstrations are learned. Its length follows the plateau instead of guessing it.

Both answer the same three questions (:class:`WarmupSchedule`): the rate of the next step, what
the step's loss was, whether to stop. They do no I/O, so a scripted loss sequence tests them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Protocol

STOP_WINDOW = 50
"""Last steps whose mean loss is compared with ``SFTSection.stop_loss``."""

EXIT_WINDOW = 25
"""Last steps whose mean loss is compared with ``SFTSection.exit_loss``: shorter than
:data:`STOP_WINDOW` because the fall off the plateau takes only a few dozen steps, and a longer
window would start the cooldown that much later."""

FLOOR = 0.1
"""Lowest learning rate of either schedule, as a fraction of the peak."""


def cosine_lr(step: int, total: int, peak: float, warmup: int) -> float:
    """Linear warm-up then cosine decay to :data:`FLOOR` (10%) of ``peak``."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (FLOOR + (1 - FLOOR) * 0.5 * (1 + math.cos(math.pi * progress)))


def window_mean(losses: Sequence[float], window: int = STOP_WINDOW) -> float:
    """Mean loss of the last ``window`` steps (nan before any step)."""
    tail = losses[-window:]
    return sum(tail) / len(tail) if tail else math.nan


def learned(losses: Sequence[float], stop_loss: float | None) -> bool:
    """Whether the mean loss of the last :data:`STOP_WINDOW` steps is below ``stop_loss``
    (None: no loss target, so it counts as learned)."""
    return stop_loss is None or (bool(losses) and window_mean(losses) < stop_loss)


class WarmupSchedule(Protocol):
    """A warm-up schedule: ``lr()`` for the next step, ``record(loss)`` after it, ``done()``."""

    losses: list[float]

    def lr(self) -> float:
        """Learning rate of the next step."""
        ...

    def record(self, loss: float) -> None:
        """Take the loss of the step just run."""
        ...

    def done(self) -> bool:
        """Whether the warm-up stops here."""
        ...

    @property
    def planned_steps(self) -> int | None:
        """Steps of the warm-up if nothing goes wrong (a progress bar's total), None: unknown."""
        ...

    def plan(self) -> str:
        """What the warm-up will run, for the log line before it."""
        ...

    def outcome(self) -> str | None:
        """A line on how the warm-up went once :meth:`done`, when there is more to say than the steps."""
        ...


class CosineRestarts:
    """``steps`` steps of linear warm-up then cosine decay to 10%, run again from the start while
    not :func:`learned`, whole runs only, up to ``max(steps, max_steps)`` steps in all."""

    def __init__(self, peak: float, warmup_steps: int, steps: int, stop_loss: float | None,
                 max_steps: int | None) -> None:
        self.peak, self.warmup_steps, self.steps, self.stop_loss = peak, warmup_steps, steps, stop_loss
        self.budget = max(steps, max_steps or 0)
        self.losses: list[float] = []

    def lr(self) -> float:
        """The cosine schedule's rate at this step of the current run."""
        return cosine_lr(len(self.losses) % self.steps, self.steps, self.peak, self.warmup_steps)

    def record(self, loss: float) -> None:
        """Take a step's loss."""
        self.losses.append(loss)

    def done(self) -> bool:
        """At the end of a run: learned, or another whole run would pass the budget."""
        n = len(self.losses)
        if n == 0 or n % self.steps:
            return False
        return learned(self.losses, self.stop_loss) or n + self.steps > self.budget

    @classmethod
    def from_section(cls, sft: Any) -> CosineRestarts:
        """The schedule the ``sft`` section's keys describe."""
        return cls(sft.lr, sft.warmup_steps, sft.steps, sft.stop_loss, sft.max_steps)

    @property
    def planned_steps(self) -> int:
        """One run of the schedule."""
        return self.steps

    def plan(self) -> str:
        """Steps of one run and the budget for restarts."""
        return f"{self.steps} steps, up to {self.budget} if not learned"

    def outcome(self) -> str | None:
        """How many runs of the schedule it took, when more than one."""
        n = len(self.losses)
        if n <= self.steps or not learned(self.losses, self.stop_loss):
            return None
        return f"learned the demonstrations after {n} steps ({n // self.steps} runs of the schedule)"


class PlateauExitSchedule:
    """Warmup-stable-decay keyed to the plateau's exit.

    Linear warm-up over ``warmup_steps``; then the peak rate until the mean loss of the last
    :data:`EXIT_WINDOW` steps falls below ``exit_loss`` (the loss has left its plateau); then a
    cosine decay to 10% over ``cooldown_steps``, and 10% after it. With a ``stop_loss`` it stops
    at the first step of the decay where the demonstrations are :func:`learned`, or at
    ``max(steps, max_steps)`` steps; without one, at the end of the cooldown or at ``steps``.
    The decay starts at the latest ``cooldown_steps`` before that cap even on the plateau, so a
    warm-up that runs out of steps still ends on a low rate.
    """

    def __init__(self, peak: float, warmup_steps: int, exit_loss: float, cooldown_steps: int,
                 steps: int, stop_loss: float | None, max_steps: int | None) -> None:
        self.peak, self.warmup_steps, self.exit_loss = peak, warmup_steps, exit_loss
        self.stop_loss = stop_loss
        self.cap = steps if stop_loss is None else max(steps, max_steps or 0)
        self.cooldown_steps = max(1, min(cooldown_steps, self.cap - warmup_steps))
        self.decay_start: int | None = None
        """Step the cooldown began at (None: still before it)."""
        self.losses: list[float] = []

    def lr(self) -> float:
        """Warm-up, peak, or the cooldown's rate at this step."""
        step = len(self.losses)
        if step < self.warmup_steps:
            return self.peak * (step + 1) / self.warmup_steps
        if self.decay_start is None:
            return self.peak
        progress = min(1.0, (step - self.decay_start) / self.cooldown_steps)
        return self.peak * (FLOOR + (1 - FLOOR) * 0.5 * (1 + math.cos(math.pi * progress)))

    def record(self, loss: float) -> None:
        """Take a step's loss; start the cooldown when the plateau is left or the cap is near."""
        self.losses.append(loss)
        n = len(self.losses)
        if self.decay_start is not None or n < self.warmup_steps:
            return
        left_plateau = n >= EXIT_WINDOW and window_mean(self.losses, EXIT_WINDOW) < self.exit_loss
        if left_plateau or n >= self.cap - self.cooldown_steps:
            self.decay_start = n

    def done(self) -> bool:
        """At the cap; or, once the cooldown began, learned (with a ``stop_loss``) or past the
        cooldown's end (without one)."""
        n = len(self.losses)
        if n >= self.cap:
            return True
        if self.decay_start is None:
            return False
        if self.stop_loss is None:
            return n >= self.decay_start + self.cooldown_steps
        return learned(self.losses, self.stop_loss)

    @classmethod
    def from_section(cls, sft: Any) -> PlateauExitSchedule:
        """The schedule the ``sft`` section's keys describe."""
        return cls(sft.lr, sft.warmup_steps, sft.exit_loss, sft.cooldown_steps, sft.steps, sft.stop_loss,
                   sft.max_steps)

    @property
    def planned_steps(self) -> None:
        """Unknown: it follows the plateau."""
        return None

    def plan(self) -> str:
        """Until learned or the cap."""
        if self.stop_loss is None:
            return f"wsd, up to {self.cap} steps"
        return f"wsd until learned, up to {self.cap} steps"

    def outcome(self) -> str | None:
        """Where the plateau was left and when it was learned."""
        if self.stop_loss is None or not learned(self.losses, self.stop_loss):
            return None
        return (f"learned the demonstrations after {len(self.losses)} steps (cooldown from step "
                f"{self.decay_start})")


SCHEDULES: dict[str, Any] = {"cosine_restarts": CosineRestarts, "wsd": PlateauExitSchedule}
"""``sft.schedule`` values and their schedules (each built by ``from_section(sft)``)."""


def make_schedule(sft: Any) -> WarmupSchedule:
    """The schedule ``sft.schedule`` names, with its keys from the ``sft`` section.

    Raises:
        ValueError: an unknown name, naming the known ones.
    """
    if sft.schedule not in SCHEDULES:
        raise ValueError(f"sft.schedule={sft.schedule!r}: expected one of {sorted(SCHEDULES)}")
    return SCHEDULES[sft.schedule].from_section(sft)
