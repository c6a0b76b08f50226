"""The warm-up's learning-rate schedules fed scripted loss sequences: the rate of every step,
when the plateau's exit is seen, when the warm-up stops; and how ``sft.schedule`` reaches the
warm-up, its checks and its cache key."""

from __future__ import annotations

import pytest

from agentloop_trainer.config import ConfigError, load_config
from agentloop_trainer.policy.lr_schedules import (
    CosineRestarts,
    PlateauExitSchedule,
    WarmupSchedule,
    cosine_lr,
)
from agentloop_trainer.task import make_problems

PEAK = 3e-3


def drive(schedule: WarmupSchedule, loss_of_step) -> list[float]:
    """Run ``schedule`` to its end on scripted losses; the rate of every step run."""
    rates = []
    while not schedule.done():
        rates.append(schedule.lr())
        schedule.record(loss_of_step(len(schedule.losses)))
        assert len(rates) < 10_000, "the schedule never stopped"
    return rates


def plateau_then_fall(exit_at: int, plateau: float = 0.3, learned_loss: float = 0.01):
    """Losses of a warm-up whose plateau ends at step ``exit_at``."""
    return lambda step: plateau if step < exit_at else learned_loss


def test_wsd_holds_the_peak_on_the_plateau_decays_after_its_exit_and_stops_once_learned():
    """Warm-up, the peak while the 25-step mean is above exit_loss, then a cosine cooldown
    started the step after the exit is seen, and a stop at the first step where the mean of the
    last 50 is below stop_loss: long before the cosine schedule's 750 steps."""
    schedule = PlateauExitSchedule(PEAK, warmup_steps=10, exit_loss=0.1, cooldown_steps=100, steps=750,
                                   stop_loss=0.02, max_steps=1500)
    rates = drive(schedule, plateau_then_fall(300))
    assert rates[:10] == pytest.approx([PEAK * (k + 1) / 10 for k in range(10)])
    # The 25-step mean falls below 0.1 once 18 of its steps are past the plateau (7 * 0.3 + 18 * 0.01).
    exit_seen = 300 + 18
    assert schedule.decay_start == exit_seen
    assert rates[10:exit_seen + 1] == [PEAK] * (exit_seen + 1 - 10)  # the cooldown's first step is at the peak
    cooldown = rates[exit_seen:]
    assert all(a > b for a, b in zip(cooldown, cooldown[1:], strict=False))
    # The 50-step mean is below 0.02 once 49 of its steps are past the plateau (1 * 0.3 + 49 * 0.01).
    assert len(schedule.losses) == 300 + 49
    assert schedule.done()


def test_wsd_cooldown_reaches_the_floor_and_holds_it_until_learned():
    """A loss that leaves the plateau but learns slowly: the rate falls to 10% of the peak over
    cooldown_steps and stays there; the warm-up goes on until learned."""
    def losses(step: int) -> float:
        return 0.3 if step < 100 else (0.07 if step < 400 else 0.01)

    schedule = PlateauExitSchedule(PEAK, warmup_steps=10, exit_loss=0.1, cooldown_steps=50, steps=750,
                                   stop_loss=0.02, max_steps=1500)
    rates = drive(schedule, losses)
    start = schedule.decay_start
    assert start == 100 + 22  # 3 * 0.3 + 22 * 0.07 < 25 * 0.1
    assert rates[start] == pytest.approx(PEAK)
    assert rates[start + 50:] == pytest.approx([0.1 * PEAK] * (len(rates) - start - 50))
    assert len(rates) == 400 + 42  # 8 * 0.07 + 42 * 0.01 < 50 * 0.02


def test_wsd_on_a_plateau_that_never_ends_decays_before_max_steps_and_stops_there_unlearned():
    """No exit: the cooldown starts cooldown_steps before max_steps, so the run ends on the floor
    rate at max_steps, and not learned (warmup_checkpoint warns)."""
    from agentloop_trainer.stages.sft import learned

    schedule = PlateauExitSchedule(PEAK, warmup_steps=10, exit_loss=0.1, cooldown_steps=40, steps=100,
                                   stop_loss=0.02, max_steps=300)
    rates = drive(schedule, lambda step: 0.3)
    assert len(rates) == 300
    assert schedule.decay_start == 260
    assert rates[259] == PEAK
    assert rates[-1] == pytest.approx(0.1 * PEAK, rel=0.02)
    assert not learned(schedule.losses, 0.02)


# A loss of 0 from step 40 on: the 25-step mean is below 0.1 after 17 such steps (8 * 0.3 < 2.5).
@pytest.mark.parametrize(("exit_at", "length"), [(None, 100), (40, 40 + 17 + 10)])
def test_wsd_without_stop_loss_runs_one_schedule_of_at_most_steps(exit_at, length):
    """stop_loss=null: one schedule, ``steps`` long at most (``sft.steps=10 sft.stop_loss=null``
    stays a 10-step smoke run), or shorter when the cooldown after an exit ends first."""
    schedule = PlateauExitSchedule(PEAK, warmup_steps=2, exit_loss=0.1, cooldown_steps=10, steps=100,
                                   stop_loss=None, max_steps=1500)
    rates = drive(schedule, (lambda step: 0.3) if exit_at is None else (lambda step: 0.3 if step < exit_at else 0.0))
    assert len(rates) == length
    assert rates[-1] < 0.2 * PEAK


def test_cosine_restarts_repeat_whole_schedules_until_learned():
    """The calibrated schedule: the cosine of ``steps`` steps from the start each run, whole runs
    only; it stops at a run's end once learned."""
    schedule = CosineRestarts(PEAK, warmup_steps=5, steps=40, stop_loss=0.02, max_steps=200)
    rates = drive(schedule, plateau_then_fall(60))
    assert len(rates) == 120
    assert rates == [cosine_lr(k % 40, 40, PEAK, 5) for k in range(120)]


def test_train_sft_runs_the_schedule_sft_schedule_names(random_model_path, tokenizer):
    """``schedule=wsd`` reaches ``train_sft``: with a stop_loss any loss meets, the warm-up stops
    at the first step of the cooldown (its cap of 20 minus 6), where cosine_restarts would run its
    whole 6-step schedule."""
    from transformers import AutoModelForCausalLM

    from agentloop_trainer.stages.sft import SFTConfig, train_sft
    from agentloop_trainer.task import BIASED_TEMPLATES

    model = AutoModelForCausalLM.from_pretrained(str(random_model_path))
    config = SFTConfig(steps=6, batch_size=1, lr=1e-4, warmup_steps=2, stop_loss=1e3, max_steps=20,
                       schedule="wsd", exit_loss=0.0, cooldown_steps=6)
    losses = train_sft(model, tokenizer, make_problems(16, 3), config, BIASED_TEMPLATES)
    assert len(losses) == 14


def test_the_schedule_is_checked_and_keys_the_cached_warmup():
    """An unknown schedule is a config error naming the choices; a schedule or cooldown that
    changes the warm-up's result changes its cache key."""
    from agentloop_trainer.stages.sft.warmup_checkpoint import sft_cache_key

    with pytest.raises(ConfigError, match=r"sft.schedule.*cosine_restarts or wsd"):
        load_config(["sft.schedule=linear"])
    keys = {sft_cache_key(load_config(o)) for o in (
        ["sft.schedule=cosine_restarts"], ["sft.schedule=wsd"], ["sft.schedule=wsd", "sft.cooldown_steps=150"],
        ["sft.schedule=wsd", "sft.exit_loss=0.05"])}
    assert len(keys) == 4


def test_a_schedule_registered_is_one_the_config_accepts(monkeypatch):
    """``sft.schedule``'s check reads the registry, so a schedule added there is a valid value
    (the check used to list the names again, and refused it) and the error lists it."""
    from agentloop_trainer.policy import lr_schedules

    class Constant(CosineRestarts):
        pass

    monkeypatch.setitem(lr_schedules.SCHEDULES, "constant", Constant)
    assert load_config(["sft.schedule=constant"]).sft.schedule == "constant"
    assert isinstance(lr_schedules.make_schedule(load_config(["sft.schedule=constant"]).sft), Constant)
    with pytest.raises(ConfigError, match=r"sft.schedule.*cosine_restarts or wsd or constant"):
        load_config(["sft.schedule=linear"])
