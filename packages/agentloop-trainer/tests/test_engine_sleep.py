"""Engines that can free their memory sleep through the update and wake before the weight sync;
engines that cannot are left alone."""

from __future__ import annotations

import dataclasses

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


@pytest.mark.parametrize("free_cache_engine", [True, False])
def test_engine_sleeps_during_the_update_and_wakes_before_the_sync(tmp_path, random_model_path, tokenizer,
                                                                   free_cache_engine):
    cfg = _cfg(tmp_path, random_model_path, "sleep", 2,
               **{"actor_rollout_ref.rollout.free_cache_engine": str(free_cache_engine).lower()})
    trainer = _trainer(cfg, tokenizer)
    server = trainer.fleet.server  # the BusyTimeServer that times the engine's calls in sync mode
    engine = server.server  # the HFServer behind it
    assert not trainer.fleet.can_sleep  # HFServer frees memory only on CUDA: nothing to do on CPU
    engine.capabilities = dataclasses.replace(engine.capabilities, sleep=True)  # as on a GPU
    events: list[str] = []
    for name in ("sleep", "wake_up", "update_weights"):
        original = getattr(server, name)

        async def traced(*args, _original=original, _name=name):
            events.append(_name)
            return await _original(*args)

        setattr(server, name, traced)
    update = trainer.actor.update

    def traced_update(*args, **kwargs):
        events.append("update")
        return update(*args, **kwargs)

    trainer.actor.update = traced_update
    try:
        metrics = [trainer.train_step(), trainer.train_step()]  # the second rollout runs after a wake-up
    finally:
        trainer.close()
    if free_cache_engine:
        assert events == ["sleep", "update", "wake_up", "update_weights"] * 2
        assert [m["rollout/engine_slept"] for m in metrics] == [1, 1]
    else:
        assert events == ["update", "update_weights"] * 2
        assert [m["rollout/engine_slept"] for m in metrics] == [0, 0]
    assert all(m["rollout/num_failed"] == 0 for m in metrics)
