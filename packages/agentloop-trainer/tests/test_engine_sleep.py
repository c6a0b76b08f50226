"""Engines that can free their memory sleep through the update and wake before the weight sync;
engines that cannot are left alone. A CPU HFServer frees its prefix cache (on by default,
``rollout.enable_prefix_caching``), so the update never holds the finished trajectories' keys
and values beside its own memory."""

from __future__ import annotations

import pytest
from test_resume import _cfg


def _trainer(cfg, tokenizer):
    from pathlib import Path

    from transformers import AutoModelForCausalLM

    from agentloop_trainer.stages import PolicyGradientTrainer
    from agentloop_trainer.stages.rollout_setup import run_records

    train, test = run_records(cfg)
    m = AutoModelForCausalLM.from_pretrained(cfg.model.path)
    e = AutoModelForCausalLM.from_pretrained(cfg.model.path)
    return PolicyGradientTrainer(cfg, m, e, tokenizer, train, test, Path(cfg.trainer.output_dir), log=lambda *_: None)


@pytest.mark.parametrize(("free_cache_engine", "prefix_caching"), [(True, True), (False, True), (True, False)])
def test_engine_sleeps_during_the_update_and_wakes_before_the_sync(tmp_path, random_model_path, tokenizer,
                                                                   free_cache_engine, prefix_caching):
    cfg = _cfg(tmp_path, random_model_path, "sleep", 2,
               **{"actor_rollout_ref.rollout.free_cache_engine": str(free_cache_engine).lower(),
                  "actor_rollout_ref.rollout.enable_prefix_caching": str(prefix_caching).lower()})
    trainer = _trainer(cfg, tokenizer)
    assert trainer.fleet is not None
    server = trainer.fleet.server  # the BusyTimeServer that times the engine's calls in sync mode
    engine = server.server  # the HFServer behind it
    # On a CPU only the prefix cache is there to free.
    assert trainer.fleet.can_sleep is prefix_caching
    assert (engine.prefix_cache is not None) is prefix_caching
    sleeps = free_cache_engine and prefix_caching
    events: list[str] = []
    for name in ("sleep", "wake_up", "update_weights"):
        original = getattr(server, name)

        async def traced(*args, _original=original, _name=name):
            events.append(_name)
            return await _original(*args)

        setattr(server, name, traced)
    update = trainer.actor.update

    held: list[int] = []

    def traced_update(*args, **kwargs):
        events.append("update")
        held.append(len(engine.prefix_cache or ()))
        return update(*args, **kwargs)

    trainer.actor.update = traced_update
    try:
        metrics = [trainer.train_step(), trainer.train_step()]  # the second rollout runs after a wake-up
    finally:
        trainer.close()
    if sleeps:
        assert events == ["sleep", "update", "wake_up", "update_weights"] * 2
        assert [m["rollout/engine_slept"] for m in metrics] == [1, 1]
        assert held == [0, 0], "the update ran beside the rollout's cached keys and values"
    else:
        assert events == ["update", "update_weights"] * 2
        assert [m["rollout/engine_slept"] for m in metrics] == [0, 0]
        if prefix_caching:  # awake through the update, but each finished trajectory was forgotten
            assert held == [0, 0]
            assert engine.stats["prefix_cache_forgotten"] > 0
    assert all(m["rollout/num_failed"] == 0 for m in metrics)
