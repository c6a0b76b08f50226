"""Hostile and careless checkpoints: a pickled payload is never executed, a ``latest`` pointer
never leads outside the run's checkpoint folder, overwriting a step never loses the old one,
and ``--resume`` with nothing to resume is an error unless asked to start fresh."""

from __future__ import annotations

import json
import os
import textwrap

import pytest
from fault_helpers import run_killed_script

pytest.importorskip("agentloop_trainer.checkpoint", reason="agentloop-trainer is not installed")
torch = pytest.importorskip("torch", reason="checkpoints need torch")

from agentloop_trainer import checkpoint  # noqa: E402
from agentloop_trainer.checkpoint import (  # noqa: E402
    CheckpointError,
    checkpoint_to_resume,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
)


class _Payload:
    """Unpickling this creates a file: what a booby-trapped checkpoint does (with os.system)."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


@pytest.mark.parametrize("name", ["model.pt", "optimizer.pt", "trainer_state.pt"])
def test_a_pickled_payload_in_a_checkpoint_is_never_executed(tmp_path, name):
    root = tmp_path / "checkpoints"
    path = save_checkpoint(root, 1, {"w": torch.ones(1)}, {"state": {}, "param_groups": []}, {"data": {}})
    marker = tmp_path / "pwned"
    torch.save({"step": 1, "evil": _Payload(str(marker))}, path / name)
    with pytest.raises(CheckpointError, match="only tensors and plain"):
        load_checkpoint(path)
    assert not marker.exists(), "loading a checkpoint ran code stored in it"


def test_a_checkpoint_round_trips_with_weights_only(tmp_path):
    import random

    import numpy as np

    random.seed(5), np.random.seed(5), torch.manual_seed(5)
    path = save_checkpoint(tmp_path, 2, {"w": torch.ones(2)}, {"state": {0: {"step": torch.tensor(3.0)}},
                                                               "param_groups": [{"lr": 0.1, "betas": (0.9, 0.99)}]},
                           {"data": {"epoch": 1, "position": 2}, "history": [{"step": 1, "loss": np.float64(0.5)}]})
    want = (random.random(), np.random.rand(), torch.rand(1))
    _, optim, state = load_checkpoint(path)
    assert optim["param_groups"][0]["betas"] == (0.9, 0.99) and state["history"][0]["loss"] == 0.5
    checkpoint.set_rng_state(state["rng"])
    assert (random.random(), np.random.rand(), torch.rand(1)) == want


def test_unsaveable_trainer_state_fails_at_save_time(tmp_path):
    with pytest.raises(CheckpointError, match=r"trainer_state\['bad'\]"):
        save_checkpoint(tmp_path, 1, {"w": torch.ones(1)}, {}, {"bad": object()})


@pytest.mark.parametrize("target", ["../elsewhere/step_1", "ABSOLUTE", "SYMLINK"])
def test_a_latest_pointer_outside_the_folder_is_refused(tmp_path, target):
    outside = tmp_path / "elsewhere"
    save_checkpoint(outside, 1, {"w": torch.ones(1)}, {}, {})
    root = tmp_path / "checkpoints"
    save_checkpoint(root, 1, {"w": torch.ones(1)}, {}, {})
    if target == "ABSOLUTE":
        target = str(outside / "step_1")
    elif target == "SYMLINK":
        (root / "step_7").symlink_to(outside / "step_1")
        target = "step_7"
    (root / "latest").write_text(json.dumps({"step": 1, "path": target}))
    with pytest.raises(CheckpointError, match="outside") as info:
        latest_checkpoint(root)
    assert "latest" in str(info.value) and "delete" in str(info.value)


def test_a_garbled_latest_pointer_names_the_fix(tmp_path):
    save_checkpoint(tmp_path, 1, {"w": torch.ones(1)}, {}, {})
    (tmp_path / "latest").write_text("{not json")
    with pytest.raises(CheckpointError, match="latest"):
        latest_checkpoint(tmp_path)


def test_a_failed_overwrite_keeps_the_old_step(tmp_path, monkeypatch):
    root = tmp_path / "checkpoints"
    save_checkpoint(root, 3, {"w": torch.ones(1)}, {}, {"data": 1})
    real_replace = os.replace

    def failing_replace(src, dst):
        if str(dst).endswith("step_3") and ".step_3." in str(src) and "replaced" not in str(src):
            raise OSError("disk gone")
        return real_replace(src, dst)

    monkeypatch.setattr(checkpoint.os, "replace", failing_replace)
    with pytest.raises(OSError, match="disk gone"):
        save_checkpoint(root, 3, {"w": torch.full((1,), 7.0)}, {}, {"data": 2})
    monkeypatch.undo()
    model, _, state = load_checkpoint(latest_checkpoint(root))
    assert model["w"].item() == 1.0 and state["data"] == 1


# SIGKILLed at the worst moment of an overwrite: the new step is complete in its temporary
# folder and about to be renamed over the old one.
KILLED_OVERWRITE = textwrap.dedent('''
    import os, signal, sys
    import torch
    from agentloop_trainer import checkpoint

    root = sys.argv[1]
    checkpoint.save_checkpoint(root, 3, {"w": torch.ones(1)}, {}, {"data": 1})
    real_replace = os.replace
    def dying_replace(src, dst):
        if str(dst).endswith("step_3") and ".step_3." in str(src) and "replaced" not in str(src):
            os.kill(os.getpid(), signal.SIGKILL)
        return real_replace(src, dst)
    checkpoint.os.replace = dying_replace
    checkpoint.save_checkpoint(root, 3, {"w": torch.full((1,), 7.0)}, {}, {"data": 2})
''')


def test_sigkill_while_overwriting_a_step_keeps_a_loadable_one(tmp_path):
    root = tmp_path / "checkpoints"
    run_killed_script(tmp_path, KILLED_OVERWRITE, root)
    path = latest_checkpoint(root)
    assert path is not None, sorted(p.name for p in root.iterdir())
    model, _, state = load_checkpoint(path)
    assert model["w"].item() == 1.0 and state["data"] == 1


def test_resume_modes(tmp_path):
    root = tmp_path / "checkpoints"
    with pytest.raises(CheckpointError, match="--resume-or-start"):
        checkpoint_to_resume(root, "must")
    assert checkpoint_to_resume(root, "auto") is None
    assert checkpoint_to_resume(root, "never") is None
    save_checkpoint(root, 1, {"w": torch.ones(1)}, {}, {})
    assert checkpoint_to_resume(root, "must") == root / "step_1"
    assert checkpoint_to_resume(root, "auto") == root / "step_1"
    assert checkpoint_to_resume(root, "never") is None


def test_cli_resume_with_no_checkpoint_is_an_error(tmp_path, capsys):
    from agentloop_trainer.cli import main

    rc = main(["train", "--resume", f"trainer.output_dir={tmp_path}", "trainer.experiment_name=nothing-here",
               "trainer.total_steps=0", "trainer.val_before_train=false"])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert "no checkpoint" in err and "--resume-or-start" in err
    assert not (tmp_path / "nothing-here" / "checkpoints").exists()


def test_resume_config_values():
    from agentloop_trainer.config import ConfigError, load_config

    assert load_config([]).trainer.resume == "never"
    assert load_config(["trainer.resume=true"]).trainer.resume == "must"
    assert load_config(["trainer.resume=false"]).trainer.resume == "never"
    assert load_config(["trainer.resume=auto"]).trainer.resume == "auto"
    with pytest.raises(ConfigError, match="trainer.resume must be never, auto or must"):
        load_config(["trainer.resume=maybe"])
