"""A CPU trainer's host memory: each phase (loading, rollout, update, evaluation) hands the heap
it freed back to the OS before the next runs, and ``trainer.host_mmap_threshold_mb`` keeps large
blocks off the heap within a phase (agentloop_core.runtime.host_memory)."""

from __future__ import annotations

import pytest
from test_engine_sleep import _trainer
from test_resume import _cfg


def test_each_phase_hands_its_heap_back_before_the_next_on_a_cpu_trainer(tmp_path, random_model_path, tokenizer,
                                                                         monkeypatch):
    """glibc keeps what a phase freed, in the arena of the thread that allocated it: on the
    real-model recipe a GRPO step sat at 8.9-13.0 GB, where a trim after the rollout left 1.8 GB
    and one after the update 4.2 GB. Loading, rollout, update and evaluation each end with one."""
    import agentloop_trainer.stages.grpo as grpo

    cfg = _cfg(tmp_path, random_model_path, "phases", 2)
    trainer = _trainer(cfg, tokenizer)
    assert trainer.fleet is not None
    events: list[str] = []
    monkeypatch.setattr(grpo, "end_of_phase", lambda device: events.append(f"release:{device.type}"))
    generate, update, evaluate = trainer.fleet.generate, trainer.actor.update, trainer.fleet.evaluate
    trainer.fleet.generate = lambda *a, **k: events.append("generate") or generate(*a, **k)
    trainer.actor.update = lambda *a, **k: events.append("update") or update(*a, **k)
    trainer.fleet.evaluate = lambda *a, **k: events.append("evaluate") or evaluate(*a, **k)
    try:
        trainer.fit()  # evaluation before RL, 2 steps, evaluation after
    finally:
        trainer.close()
    step = ["generate", "release:cpu", "update", "release:cpu"]
    evaluation = ["evaluate", "generate", "release:cpu"]  # the evaluation rolls out through generate
    assert events == ["release:cpu", *evaluation, *step, *step, *evaluation]


def test_only_a_cpu_trainer_trims_the_heap(monkeypatch):
    """On an accelerator the phases' tensors are not on the host heap: no trim (it walks the
    whole heap, ~0.5 s per 5 GB)."""
    import torch

    import agentloop_trainer.stages.memory as memory

    calls: list[str] = []
    monkeypatch.setattr(memory, "release_host_memory", lambda: calls.append("trim"))
    memory.end_of_phase(torch.device("cpu"))
    memory.end_of_phase(torch.device("meta"))
    memory.end_of_phase(torch.device("cuda", 0))
    assert calls == ["trim"]



def test_the_mmap_threshold_is_set_for_a_cpu_trainer_only(monkeypatch):
    import agentloop_trainer.stages.memory as memory

    calls: list[int] = []
    monkeypatch.setattr(memory, "map_large_blocks", lambda size: calls.append(size) or True)
    from agentloop_trainer.config.sections import TrainerSection

    assert memory.map_large_host_blocks(TrainerSection(host_mmap_threshold_mb=8)) is True
    assert memory.map_large_host_blocks(TrainerSection()) is False
    assert memory.map_large_host_blocks(TrainerSection(device="cuda", host_mmap_threshold_mb=8)) is False
    assert calls == [8 << 20]


@pytest.mark.parametrize("value", ["0", "33"])
def test_a_threshold_glibc_refuses_names_the_key_and_the_range(value):
    from agentloop_trainer.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=r"trainer.host_mmap_threshold_mb.*1 to 32"):
        load_config([f"trainer.host_mmap_threshold_mb={value}"])


def test_the_threshold_is_off_unless_set():
    from agentloop_trainer.config import load_config

    assert load_config([]).trainer.host_mmap_threshold_mb is None
    assert load_config(["trainer.host_mmap_threshold_mb=8"]).trainer.host_mmap_threshold_mb == 8


def test_each_fsdp_rank_sets_the_threshold_in_its_own_process(monkeypatch):
    """Ranks are processes of their own: the driver's mallopt does not reach them."""
    import torch.distributed as dist

    import agentloop_trainer.stages.build as build
    from agentloop_trainer.config import load_config
    from agentloop_trainer.config.loading import to_yaml

    calls: list[tuple[str, int | None]] = []
    monkeypatch.setattr(build, "map_large_host_blocks",
                        lambda trainer: calls.append((trainer.device, trainer.host_mmap_threshold_mb)) or True)
    monkeypatch.setattr(dist, "get_world_size", lambda: 2)

    def stop(*_a, **_k):
        raise RuntimeError("stop before building")

    monkeypatch.setattr(build, "build_trainer", stop)
    cfg = load_config(["trainer.host_mmap_threshold_mb=16"])
    with pytest.raises(RuntimeError, match="stop before building"):
        build._train_rank(1, to_yaml(cfg), "unused", "unused")
    assert calls == [("cpu", 16)]
