"""``--resume`` in ``trainer.mode=one_step_off|async``: the checkpoint keeps the groups started
but not yet trained, and the resumed run trains the prompts the uninterrupted run trained, step
by step; the buffer's restore keeps each group's index and deadline."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from agentloop_trainer.config import load_config
from agentloop_trainer.stages import StalenessBuffer


def test_restore_keeps_indices_and_deadlines():
    buf = StalenessBuffer(batch_groups=2, max_staleness=1)
    # Saved after two steps: groups 5 and 7 of version -1 (due now), 8 of version 0; 6 was trained.
    reopened = buf.restore(9, [(7, -1), (5, -1), (8, 0)])
    assert [(g.index, g.start_version) for g in reopened] == [(5, -1), (7, -1), (8, 0)]
    assert [g.index for g in buf.open_groups] == [5, 7, 8]
    assert buf.started == 9
    assert [g.index for g in buf.due()] == [5, 7]
    assert buf.can_start(0), "new groups continue the saved numbering"
    assert buf.start(0).index == 9, "new groups continue the saved numbering"
    assert not buf.can_start(0), "the admission counts the reopened groups"
    for g in (reopened[2], reopened[1]):
        buf.finish(g, None)
    assert not buf.ready(), "group 5 is due this step: the step waits for it rather than skip it"
    buf.finish(reopened[0], None)
    assert [g.index for g in buf.take()] == [5, 7]


@pytest.mark.parametrize(("started", "groups", "message"), [
    (3, [(3, 0)], r"in \[0, 3\)"),
    (3, [(1, 0), (1, 0)], "must be distinct"),
    (9, [(1, -1), (2, -1), (3, -1)], "cannot all be trained"),
    (9, [(1, -2)], "cannot all be trained"),
])
def test_restore_refuses_a_state_this_buffer_could_not_have_written(started, groups, message):
    with pytest.raises(ValueError, match=message):
        StalenessBuffer(batch_groups=2, max_staleness=1).restore(started, groups)


def test_restore_needs_a_fresh_buffer():
    buf = StalenessBuffer(batch_groups=2, max_staleness=1)
    buf.start(0)
    with pytest.raises(RuntimeError, match="fresh buffer"):
        buf.restore(3, [])


def _cfg(tmp_path, model_path, name, mode, steps, **extra):
    return load_config([
        f"model.path={model_path}", f"trainer.total_steps={steps}", f"trainer.output_dir={tmp_path}",
        f"trainer.experiment_name={name}", "trainer.test_freq=0", "trainer.save_freq=2", "trainer.progress_bar=false",
        "trainer.val_before_train=false", "trainer.save_hf=false", "data.train_size=32", "data.val_size=2",
        "data.train_batch_size=2", "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.rollout.multi_turn.max_tokens_per_turn=12", "data.max_response_length=40",
        f"trainer.mode={mode}",
    ] + [f"{k}={v}" for k, v in extra.items()])


def _fit(cfg, tokenizer):
    from transformers import AutoModelForCausalLM

    from agentloop_trainer.stages import PolicyGradientTrainer
    from agentloop_trainer.stages.rollout_setup import run_records

    train, test = run_records(cfg)
    trainer = PolicyGradientTrainer(cfg, AutoModelForCausalLM.from_pretrained(cfg.model.path),
                          AutoModelForCausalLM.from_pretrained(cfg.model.path), tokenizer, train, test,
                          Path(cfg.trainer.output_dir) / cfg.trainer.experiment_name, log=lambda *_: None)
    try:
        trainer.fit()
    finally:
        trainer.close()
    return trainer


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["one_step_off", "async"])
def test_resume_trains_the_uninterrupted_runs_prompts_per_step(tmp_path, random_model_path, tokenizer, mode):
    """The uninterrupted run saves at step 2 and goes on to step 5; a second run resumes that
    checkpoint. With ``max_staleness=1`` the groups open at the checkpoint are due at step 3,
    so the buffer decides each later step's groups the same way in both runs, and they must
    match (group index and training-data row). Were the checkpoint to keep only the data
    position, the resumed step 3 would train rows drawn after the open groups' rows."""
    import torch

    full = _fit(_cfg(tmp_path, random_model_path, "full", mode, 5), tokenizer)
    saved = tmp_path / "full" / "checkpoints" / "step_2"
    state = torch.load(saved / "trainer_state.pt", weights_only=True)["async"]
    assert state["open_groups"], "the test needs groups in flight or waiting at the checkpoint to mean anything"

    root = tmp_path / "resumed" / "checkpoints"
    root.mkdir(parents=True)
    shutil.copytree(saved, root / "step_2")
    (root / "latest").write_text(json.dumps({"step": 2, "path": "step_2"}))
    resumed = _fit(_cfg(tmp_path, random_model_path, "resumed", mode, 5, **{"trainer.resume": "must"}), tokenizer)

    assert sorted(full.async_driver.trained_groups) == [1, 2, 3, 4, 5]
    assert sorted(resumed.async_driver.trained_groups) == [3, 4, 5]
    for step in (3, 4, 5):
        assert resumed.async_driver.trained_groups[step] == full.async_driver.trained_groups[step], step
    replayed = {g["index"] for g in state["open_groups"]}
    assert {i for i, _ in resumed.async_driver.trained_groups[3]} <= replayed, "step 3 trains the replayed groups"
    assert [h["step"] for h in resumed.history if "actor/pg_loss" in h] == [1, 2, 3, 4, 5]
    assert resumed.fleet.server.ledger_size == 0
