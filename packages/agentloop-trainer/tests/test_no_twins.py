"""One concept, one type: no two dataclasses of the trainer declare the same keys (#47). A record
built from a config section at run time extends the section (``ActorConfig(ActorSection)``,
``JudgeSettings(JudgeSection)``) instead of listing its fields again, so a key added to the
section reaches the record and its default is declared once."""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil

import agentloop_trainer

SHARED = 4
"""Fields two unrelated dataclasses may have in common before they count as twins (``enable``,
``path``, ``lr``... recur honestly)."""
APART = {
    frozenset({"TrainerSection", "SFTSection"}):
        "two stages' own schedules (trainer.* for RL, sft.* for SFT): the same key names, other defaults and types",
}
"""Pairs that share keys but are two concepts, each with the reason."""


def _own_fields(cls: type) -> set[str]:
    """The fields ``cls`` declares itself (not inherited from a dataclass base)."""
    inherited = {f.name for base in cls.__mro__[1:] if dataclasses.is_dataclass(base) for f in dataclasses.fields(base)}
    return {f.name for f in dataclasses.fields(cls)} - inherited


def _dataclasses() -> list[type]:
    found: dict[str, type] = {}
    for info in pkgutil.walk_packages(agentloop_trainer.__path__, "agentloop_trainer."):
        try:
            module = importlib.import_module(info.name)
        except ImportError:  # an optional extra (wandb, mlflow...) not installed here
            continue
        for value in vars(module).values():
            if isinstance(value, type) and dataclasses.is_dataclass(value) and value.__module__ == info.name:
                found[f"{value.__module__}.{value.__qualname__}"] = value
    return list(found.values())


def test_no_two_dataclasses_declare_the_same_keys():
    classes = _dataclasses()
    assert len(classes) > 40, "the walk must see the trainer's sections"
    twins = []
    for i, a in enumerate(classes):
        for b in classes[i + 1:]:
            if issubclass(a, b) or issubclass(b, a) or frozenset({a.__name__, b.__name__}) in APART:
                continue
            common = _own_fields(a) & _own_fields(b)
            if len(common) > SHARED:
                twins.append(f"{a.__module__}.{a.__qualname__} / {b.__module__}.{b.__qualname__}: {sorted(common)}")
    assert not twins, "declare each key once (extend the section instead):\n" + "\n".join(twins)


def test_the_judges_runtime_record_is_its_section():
    from agentloop_trainer.reward.judge import JudgeSettings
    from agentloop_trainer.reward.settings import JudgeSection
    from agentloop_trainer.update.actor import ActorConfig
    from agentloop_trainer.update.settings import ActorSection

    assert issubclass(JudgeSettings, JudgeSection)
    assert _own_fields(JudgeSettings) == {"criteria"}
    assert issubclass(ActorConfig, ActorSection)
