"""Checkpoints with everything a resumed run needs to continue exactly: model, optimizer,
step, data position and RNG states, plus a Hugging Face folder of the policy.

The trainer writes the sharded format (:mod:`agentloop_trainer.checkpoint.sharded`: each rank
its own shards, resumable on any number of ranks); this module holds what every format shares
(the step folders, the ``latest`` pointer, the atomic commit, RNG and plain-type state) and the
single-file format of agentloop 0.3 (``model.pt``, ``optimizer.pt``, ``trainer_state.pt``: full
states written by rank 0), which still loads, on the number of ranks that wrote it.

Safety, because a checkpoint folder is input like any other (copied between machines, shared,
downloaded):

- Nothing is unpickled: tensors and plain types (dicts, lists, tuples, str, int, float, bool,
  None) are loaded with ``torch.load(weights_only=True)``, which refuses any other object
  (unpickling arbitrary objects would run whatever code the file names); the sharded format's
  tensors are safetensors.
- The ``latest`` pointer must name a folder inside the checkpoint folder; ``../elsewhere``, an
  absolute path or a symlink out is refused.
- A step is written to a temporary folder in the same folder, every file and the folder are
  fsynced, then it is renamed into place. Overwriting a step first moves the old one aside to
  ``.step_<N>.replaced`` and deletes it only once the new one is in place; a run killed in
  between is recovered by :func:`latest_checkpoint`.
"""

from __future__ import annotations

import json
import os
import pickle
import random
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

LATEST = "latest"
RESUME_MODES = ("never", "auto", "must")
"""Values of ``trainer.resume``: never load a checkpoint; load the latest if there is one
(``--resume-or-start``); load the latest and fail if there is none (``--resume``)."""
_FILES = ("model.pt", "optimizer.pt", "trainer_state.pt")


class CheckpointError(ValueError):
    """A checkpoint cannot be saved, found or trusted; the message names the fix."""


def rng_state() -> dict[str, Any]:
    """Python, numpy and torch RNG states, as tensors and plain types."""
    import torch

    version, internal, gauss_next = random.getstate()
    legacy = np.random.get_state(legacy=True)
    if not isinstance(legacy, tuple):  # numpy returns a dict for any bit generator but MT19937
        raise CheckpointError("numpy's global RNG is not the legacy MT19937 one, so its state cannot be saved; "
                              "seed it with np.random.seed instead of setting another bit generator's state")
    _, key, pos, has_gauss, gauss = legacy
    return {
        "python": {"version": version, "state": list(internal), "gauss_next": gauss_next},
        "numpy": {"key": torch.from_numpy(key.astype(np.int64)), "pos": int(pos), "has_gauss": int(has_gauss),
                  "gauss": float(gauss)},
        "torch": torch.get_rng_state(),
    }


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what :func:`rng_state` captured."""
    import torch

    py, npy = state["python"], state["numpy"]
    random.setstate((py["version"], tuple(py["state"]), py["gauss_next"]))
    np.random.set_state(("MT19937", npy["key"].numpy().astype(np.uint32), npy["pos"], npy["has_gauss"], npy["gauss"]))
    torch.set_rng_state(state["torch"])


def _plain(value: Any, where: str) -> Any:
    """``value`` as tensors and plain types (numpy scalars and arrays converted), or a
    :class:`CheckpointError` naming the first entry that is neither."""
    import torch

    if isinstance(value, np.generic):  # before float: np.float64 is a float subclass that pickles as numpy's
        return value.item()
    if value is None or type(value) in (str, bool, int, float) or isinstance(value, torch.Tensor):
        return value
    for base in (bool, int, float, str):  # IntEnum, str enums...: their class would be a pickled global
        if isinstance(value, base):
            return base(value)
    if isinstance(value, np.ndarray):
        return torch.from_numpy(value)
    if isinstance(value, dict):
        return {k: _plain(v, f"{where}[{k!r}]") for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        items = [_plain(v, f"{where}[{i}]") for i, v in enumerate(value)]
        return items if isinstance(value, list) else tuple(items)
    raise CheckpointError(f"{where} is a {type(value).__name__}; checkpoints hold only tensors and plain types "
                          "(dict, list, tuple, str, int, float, bool, None), so convert it before saving")


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _commit(root: Path, step: int, tmp: Path) -> Path:
    """Rename the complete, fsynced step folder ``tmp`` to ``<root>/step_<step>`` (an existing
    one is moved aside first and restored if the rename fails) and point ``latest`` at it."""
    target = root / f"step_{step}"
    aside = root / f".step_{step}.replaced"
    if target.exists():
        shutil.rmtree(aside, ignore_errors=True)
        os.replace(target, aside)
    try:
        os.replace(tmp, target)
    except BaseException:
        if aside.exists() and not target.exists():
            os.replace(aside, target)
        raise
    _fsync(root)
    shutil.rmtree(aside, ignore_errors=True)
    pointer = root / f".{LATEST}.tmp"
    with open(pointer, "w") as f:
        f.write(json.dumps({"step": step, "path": target.name}))
        f.flush()
        os.fsync(f.fileno())
    os.replace(pointer, root / LATEST)
    _fsync(root)
    return target


def save_checkpoint(root: str | Path, step: int, model_state: dict[str, Any], optimizer_state: dict[str, Any],
                    trainer_state: dict[str, Any]) -> Path:
    """Write ``<root>/step_<step>`` in the single-file format of agentloop 0.3 (full states in
    ``model.pt`` and ``optimizer.pt``) atomically and point ``<root>/latest`` at it. The trainer
    writes :func:`save_sharded_checkpoint`; this stays for full states held in one process.

    Args:
        root: The run's checkpoint folder.
        step: Steps completed.
        model_state: Full (unsharded) model state dict.
        optimizer_state: Optimizer state dict.
        trainer_state: Data position, metrics history: tensors and plain types only.

    Returns:
        The checkpoint folder.

    Raises:
        CheckpointError: something in the states is not a tensor or plain type (nothing is written).
    """
    import torch

    states = (_plain(model_state, "model_state"), _plain(optimizer_state, "optimizer_state"),
              _plain({"step": step, "rng": rng_state(), **trainer_state}, "trainer_state"))
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".step_{step}.", dir=root))
    try:
        for name, state in zip(_FILES, states, strict=True):
            torch.save(state, tmp / name)
            _fsync(tmp / name)
        _fsync(tmp)
        return _commit(root, step, tmp)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def latest_checkpoint(root: str | Path) -> Path | None:
    """The folder ``<root>/latest`` points at, or None when there is no pointer.

    Raises:
        CheckpointError: the pointer is unreadable, or leads outside ``root``.
    """
    root = Path(root)
    pointer = root / LATEST
    if not pointer.exists():
        return None
    fix = f"delete {pointer} (and resume from an explicit step folder) or restore it"
    try:
        name = json.loads(pointer.read_text())["path"]
        if not isinstance(name, str):
            raise TypeError(name)
    except (ValueError, KeyError, TypeError, UnicodeDecodeError):
        raise CheckpointError(f"{pointer} is not a checkpoint pointer ({{\"step\": N, \"path\": \"step_N\"}}); "
                              f"{fix}") from None
    path = root / name
    if not path.resolve().is_relative_to(root.resolve()) or path.resolve() == root.resolve():
        raise CheckpointError(f"{pointer} points at {name!r}, outside {root}; a checkpoint pointer must name a "
                              f"folder inside it: {fix}")
    if not path.exists():
        aside = root / f".{path.name}.replaced"
        if aside.is_dir() and (aside / "trainer_state.pt").exists():
            # Killed while overwriting this step: the old one is complete, the new one never landed.
            os.replace(aside, path)
        else:
            return None
    return path


def checkpoint_to_resume(root: str | Path, mode: str) -> Path | None:
    """The checkpoint a run with ``trainer.resume=<mode>`` starts from.

    Args:
        root: The run's checkpoint folder.
        mode: One of :data:`RESUME_MODES`.

    Raises:
        CheckpointError: ``mode`` is ``must`` and there is no checkpoint.
    """
    if mode not in RESUME_MODES:
        raise CheckpointError(f"trainer.resume must be one of {RESUME_MODES}, not {mode!r}")
    if mode == "never":
        return None
    path = latest_checkpoint(root)
    if path is None and mode == "must":
        raise CheckpointError(f"--resume: no checkpoint to resume under {root}. Check trainer.experiment_name "
                              "(or trainer.run_dir) names the run, or pass --resume-or-start "
                              "(trainer.resume=auto) to start fresh when there is none")
    return path


STATE_DIR = "state"
"""DCP's safetensors files in a step folder."""
HF_DIR = "hf"
"""The Hugging Face folder in a step folder."""


def _load_plain(file: Path) -> Any:
    """A ``torch.save`` file of tensors and plain types, loaded without unpickling anything else."""
    import torch

    try:
        return torch.load(file, weights_only=True)
    except pickle.UnpicklingError as exc:
        raise CheckpointError(
            f"{file} holds objects other than tensors and plain types and is not loaded (unpickling "
            f"them could run code); checkpoints hold only tensors and plain types. If you wrote it yourself "
            f"with an older agentloop, re-save it with this one. ({str(exc).splitlines()[0]})") from None


def is_sharded_checkpoint(path: str | Path) -> bool:
    """Whether ``path`` is in the sharded format (a ``state/`` folder) rather than 0.3's."""
    return (Path(path) / STATE_DIR).is_dir()


def load_checkpoint(path: str | Path) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """``(model_state, optimizer_state, trainer_state)`` of a checkpoint folder in the 0.3
    single-file format (RNG not yet restored: call :func:`set_rng_state` with
    ``trainer_state["rng"]``).

    Raises:
        FileNotFoundError: the folder is not a complete checkpoint.
        CheckpointError: a file holds something other than tensors and plain types, or the
            folder is a sharded checkpoint (load it with :func:`load_sharded_checkpoint`).
    """
    path = Path(path)
    if is_sharded_checkpoint(path):
        raise CheckpointError(f"{path} is a sharded checkpoint (state/); load it into a model and optimizer with "
                              "agentloop_trainer.checkpoint.sharded.load_sharded_checkpoint")
    if not (path / "trainer_state.pt").exists():
        raise FileNotFoundError(f"{path} is not a complete checkpoint (no trainer_state.pt)")
    model, optim, state = (_load_plain(path / name) for name in _FILES)
    return model, optim, state
