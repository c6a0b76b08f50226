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

from agentloop_trainer.checkpoint import (  # noqa: E402
    CheckpointError,
    checkpoint_to_resume,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from agentloop_trainer.checkpoint import common as checkpoint  # noqa: E402
from agentloop_trainer.checkpoint import sharded as sharded_checkpoint  # noqa: E402


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
    assert optim["param_groups"][0]["betas"] == (0.9, 0.99)
    assert state["history"][0]["loss"] == 0.5
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
    assert "latest" in str(info.value)
    assert "delete" in str(info.value)


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
    assert model["w"].item() == 1.0
    assert state["data"] == 1


# SIGKILLed at the worst moment of an overwrite: the new step is complete in its temporary
# folder and about to be renamed over the old one.
KILLED_OVERWRITE = textwrap.dedent('''
    import os, signal, sys
    import torch
    from agentloop_trainer.checkpoint import common as checkpoint

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
    assert model["w"].item() == 1.0
    assert state["data"] == 1


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
    assert "no checkpoint" in err
    assert "--resume-or-start" in err
    assert not (tmp_path / "nothing-here" / "checkpoints").exists()


def test_resume_config_values():
    from agentloop_trainer.config import ConfigError, load_config

    assert load_config([]).trainer.resume == "never"
    assert load_config(["trainer.resume=true"]).trainer.resume == "must"
    assert load_config(["trainer.resume=false"]).trainer.resume == "never"
    assert load_config(["trainer.resume=auto"]).trainer.resume == "auto"
    with pytest.raises(ConfigError, match="trainer.resume must be never, auto or must"):
        load_config(["trainer.resume=maybe"])


# -- the sharded format: DCP safetensors shards + a plain trainer state --------------------------


def _trained():
    """A small module and its AdamW after one step (state to save)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(5, 4)).sum().backward()
    optimizer.step()
    return model, optimizer


def _fresh():
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    return model, torch.optim.AdamW(model.parameters(), lr=0.5)


def _saved_sharded(tmp_path):
    model, optimizer = _trained()
    path = sharded_checkpoint.save_sharded_checkpoint(tmp_path / "checkpoints", 1, model, optimizer, {"data": {"epoch": 0}})
    [shard] = (path / "state").iterdir()
    return model, optimizer, path, shard


def test_loading_a_sharded_checkpoint_never_unpickles(tmp_path, monkeypatch):
    """The state files are safetensors (a JSON header, raw bytes) and the trainer state goes
    through torch's weights-only loader: with every pickle entry point booby-trapped, the load
    still restores the model and the optimizer exactly. A failure names the code path that
    reached pickle (DCP's FileSystemReader reads its .metadata that way)."""
    import pickle

    model, optimizer, path, _ = _saved_sharded(tmp_path)

    def trapped(*_a, **_k):
        raise AssertionError("loading a checkpoint called pickle")

    for name in ("load", "loads", "Unpickler", "_Unpickler"):
        monkeypatch.setattr(pickle, name, trapped)
    fresh, fresh_optimizer = _fresh()
    state = sharded_checkpoint.load_sharded_checkpoint(path, fresh, fresh_optimizer)
    monkeypatch.undo()
    assert state["step"] == 1
    assert state["data"] == {"epoch": 0}
    for (name, want), got in zip(model.state_dict().items(), fresh.state_dict().values(), strict=True):
        assert torch.equal(want, got), name
    want, got = optimizer.state_dict(), fresh_optimizer.state_dict()
    assert got["param_groups"] == want["param_groups"]  # lr 0.1 back, not the fresh optimizer's 0.5
    for index, entries in want["state"].items():
        for key, value in entries.items():
            assert torch.equal(got["state"][index][key], value), (index, key)


def test_a_pickled_payload_in_a_sharded_trainer_state_is_never_executed(tmp_path):
    _, _, path, _ = _saved_sharded(tmp_path)
    marker = tmp_path / "pwned"
    torch.save({"step": 1, "evil": _Payload(str(marker))}, path / "trainer_state.pt")
    with pytest.raises(CheckpointError, match="only tensors and plain"):
        sharded_checkpoint.load_sharded_checkpoint(path, *_fresh())
    assert not marker.exists(), "loading a checkpoint ran code stored in it"


def _rewrite_header(shard, edit) -> None:
    """Apply ``edit`` to a safetensors file's JSON header, keeping the data bytes."""
    import struct

    raw = shard.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    edit(header)
    text = json.dumps(header).encode()
    shard.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + n :])


def _offsets_outside(header):
    sharding = json.loads(header["__metadata__"]["DCP_SHARDING_INFO"])
    sharding["model.0.weight"]["saved_offsets"] = [2, 0]  # a [3, 4] chunk at row 2 of a [3, 4] tensor
    header["__metadata__"]["DCP_SHARDING_INFO"] = json.dumps(sharding)


def _data_outside(header):
    header["model.0.weight"]["data_offsets"] = [0, 10**9]  # bytes far past the end of the file


@pytest.mark.parametrize("tamper", ["offsets_outside", "data_outside", "missing", "missing_and_unlisted", "extra",
                                    "truncated", "symlink"])
def test_a_tampered_sharded_checkpoint_is_refused_naming_the_fix(tmp_path, tamper):
    """Headers that place a chunk outside its tensor or point past the file, a missing, unlisted,
    extra, truncated or symlinked state file: each is a CheckpointError naming the file and the
    fix before DCP reads anything, never a half-loaded model. The manifest in trainer_state.pt
    is rewritten to agree where a consistent forger would, so the header checks stand alone."""
    _, _, path, shard = _saved_sharded(tmp_path)
    state = torch.load(path / "trainer_state.pt", weights_only=True)
    if tamper in ("offsets_outside", "data_outside"):
        _rewrite_header(shard, _offsets_outside if tamper == "offsets_outside" else _data_outside)
        state["files"][shard.name] = shard.stat().st_size
        torch.save(state, path / "trainer_state.pt")
    elif tamper.startswith("missing"):
        shard.unlink()
        if tamper == "missing_and_unlisted":
            state["files"] = {}
            torch.save(state, path / "trainer_state.pt")
    elif tamper == "extra":
        (shard.parent / "shard-00009-model-00001-of-00001.safetensors").write_bytes(shard.read_bytes())
    elif tamper == "truncated":
        shard.write_bytes(shard.read_bytes()[:-8])
    else:
        outside = tmp_path / "elsewhere.safetensors"
        os.replace(shard, outside)
        shard.symlink_to(outside)
    want = {"offsets_outside": "outside the tensor", "data_outside": "not a readable state file",
            "missing": "is missing", "missing_and_unlisted": "do not hold all of", "extra": "not one of",
            "truncated": "bytes, not the", "symlink": "symlink"}[tamper]
    fresh, fresh_optimizer = _fresh()
    before = {k: v.clone() for k, v in fresh.state_dict().items()}
    with pytest.raises(CheckpointError, match=want) as info:
        sharded_checkpoint.load_sharded_checkpoint(path, fresh, fresh_optimizer)
    assert "earlier step" in str(info.value) or "remove it" in str(info.value), str(info.value)
    assert all(torch.equal(before[k], v) for k, v in fresh.state_dict().items()), "the model was partly loaded"


def test_a_sharded_checkpoint_of_another_model_is_refused(tmp_path):
    _, _, path, _ = _saved_sharded(tmp_path)
    other = torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.Linear(5, 2))
    with pytest.raises(CheckpointError, match="another model or optimizer setup"):
        sharded_checkpoint.load_sharded_checkpoint(path, other, torch.optim.AdamW(other.parameters()))


def test_the_single_file_loader_points_at_the_sharded_one(tmp_path):
    _, _, path, _ = _saved_sharded(tmp_path)
    with pytest.raises(CheckpointError, match="load_sharded_checkpoint"):
        load_checkpoint(path)


# SIGKILLed after every rank wrote its state files, just before the step folder is renamed in.
KILLED_SHARDED_SAVE = textwrap.dedent('''
    import os, signal, sys
    import torch
    from agentloop_trainer.checkpoint import sharded as sharded_checkpoint

    root = sys.argv[1]
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    sharded_checkpoint.save_sharded_checkpoint(root, 1, model, optimizer, {"data": 1})
    def dying_fsync_tree(folder):
        os.kill(os.getpid(), signal.SIGKILL)
    sharded_checkpoint._fsync_tree = dying_fsync_tree
    sharded_checkpoint.save_sharded_checkpoint(root, 2, model, optimizer, {"data": 2})
''')


def test_sigkill_during_a_sharded_save_keeps_the_previous_checkpoint(tmp_path):
    root = tmp_path / "checkpoints"
    run_killed_script(tmp_path, KILLED_SHARDED_SAVE, root)
    assert [p.name for p in root.iterdir() if p.name.startswith(".step_2")], "the kill came before any write"
    assert not (root / "step_2").exists()
    path = latest_checkpoint(root)
    assert path is not None
    assert path.name == "step_1"
    model = torch.nn.Linear(2, 2)
    assert sharded_checkpoint.load_sharded_checkpoint(path, model, torch.optim.AdamW(model.parameters()))["data"] == 1
