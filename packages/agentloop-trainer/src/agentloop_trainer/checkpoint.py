"""Checkpoints with everything a resumed run needs to continue exactly: model, optimizer,
step, data position and RNG states. Written to a temporary folder and renamed into place, so a
run killed mid-save leaves the previous checkpoint intact."""

from __future__ import annotations

import json
import os
import random
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

LATEST = "latest"


def rng_state() -> dict[str, Any]:
    """Python, numpy and torch RNG states."""
    import torch

    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what :func:`rng_state` captured."""
    import torch

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])


def save_checkpoint(root: str | Path, step: int, model_state: dict[str, Any], optimizer_state: dict[str, Any],
                    trainer_state: dict[str, Any]) -> Path:
    """Write ``<root>/step_<step>`` atomically and point ``<root>/latest`` at it.

    Args:
        root: The run's checkpoint folder.
        step: Steps completed.
        model_state: Full (unsharded) model state dict.
        optimizer_state: Optimizer state dict.
        trainer_state: Data position, metrics history, anything JSON-able or torch-saveable.

    Returns:
        The checkpoint folder.
    """
    import torch

    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    target = root / f"step_{step}"
    tmp = Path(tempfile.mkdtemp(prefix=f".step_{step}.", dir=root))
    try:
        torch.save(model_state, tmp / "model.pt")
        torch.save(optimizer_state, tmp / "optimizer.pt")
        torch.save({"step": step, "rng": rng_state(), **trainer_state}, tmp / "trainer_state.pt")
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    pointer = root / f".{LATEST}.tmp"
    pointer.write_text(json.dumps({"step": step, "path": target.name}))
    os.replace(pointer, root / LATEST)
    return target


def latest_checkpoint(root: str | Path) -> Path | None:
    """The folder ``<root>/latest`` points at, or None."""
    pointer = Path(root) / LATEST
    if not pointer.exists():
        return None
    path = Path(root) / json.loads(pointer.read_text())["path"]
    return path if path.exists() else None


def load_checkpoint(path: str | Path) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """``(model_state, optimizer_state, trainer_state)`` of a checkpoint folder (RNG not yet
    restored: call :func:`set_rng_state` with ``trainer_state["rng"]``)."""
    import torch

    path = Path(path)
    if not (path / "trainer_state.pt").exists():
        raise FileNotFoundError(f"{path} is not a complete checkpoint (no trainer_state.pt)")
    return (
        torch.load(path / "model.pt", weights_only=True),
        torch.load(path / "optimizer.pt", weights_only=False),
        torch.load(path / "trainer_state.pt", weights_only=False),
    )
