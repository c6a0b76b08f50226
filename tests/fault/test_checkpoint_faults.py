"""Training faults: a trainer SIGKILLed while writing a checkpoint never leaves a partial
checkpoint that a resume would load."""

from __future__ import annotations

import textwrap

import pytest
from fault_helpers import run_killed_script

pytest.importorskip("agentloop_trainer.checkpoint", reason="agentloop-trainer is not installed")
torch = pytest.importorskip("torch", reason="checkpoints need torch")

from agentloop_trainer.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint  # noqa: E402

# Saves step 1 cleanly, then dies by SIGKILL halfway through writing step 2 (after model.pt,
# before optimizer.pt): the state a power cut or an OOM kill leaves behind.
KILLED_SAVE = textwrap.dedent('''
    import os, signal, sys
    import torch
    from agentloop_trainer.checkpoint import common as checkpoint

    root = sys.argv[1]
    checkpoint.save_checkpoint(root, 1, {"w": torch.ones(3)}, {"lr": 1}, {"data": {"epoch": 0, "pos": 2}})
    real_save = torch.save
    def dying_save(obj, path, *a, **k):
        real_save(obj, path, *a, **k)
        if str(path).endswith("model.pt"):
            os.kill(os.getpid(), signal.SIGKILL)
    torch.save = dying_save
    checkpoint.save_checkpoint(root, 2, {"w": torch.zeros(3)}, {"lr": 2}, {"data": {"epoch": 0, "pos": 4}})
''')


def test_sigkill_during_save_keeps_the_previous_checkpoint(tmp_path):
    root = tmp_path / "checkpoints"
    run_killed_script(tmp_path, KILLED_SAVE, root)
    # Something of step 2 was written (so the test did interrupt a save) ...
    leftovers = [p.name for p in root.iterdir() if p.name.startswith(".step_2")]
    assert leftovers, sorted(p.name for p in root.iterdir())
    # ... but resume sees only the complete step 1.
    assert not (root / "step_2").exists()
    path = latest_checkpoint(root)
    assert path is not None
    assert path.name == "step_1"
    model, optim, state = load_checkpoint(path)
    assert torch.equal(model["w"], torch.ones(3))
    assert optim == {"lr": 1}
    assert state["step"] == 1
    assert state["data"] == {"epoch": 0, "pos": 2}


def test_a_checkpoint_folder_missing_files_is_refused(tmp_path):
    root = tmp_path / "checkpoints"
    save_checkpoint(root, 1, {"w": torch.ones(1)}, {}, {})
    (root / "step_1" / "trainer_state.pt").unlink()
    with pytest.raises(FileNotFoundError, match="not a complete checkpoint"):
        load_checkpoint(root / "step_1")


def test_overwriting_a_step_is_atomic_too(tmp_path):
    root = tmp_path / "checkpoints"
    save_checkpoint(root, 3, {"w": torch.ones(1)}, {}, {"data": 1})
    save_checkpoint(root, 3, {"w": torch.full((1,), 7.0)}, {}, {"data": 2})
    model, _, state = load_checkpoint(latest_checkpoint(root))
    assert model["w"].item() == 7.0
    assert state["data"] == 2
    assert [p.name for p in root.iterdir() if p.name.startswith(".")] == []
