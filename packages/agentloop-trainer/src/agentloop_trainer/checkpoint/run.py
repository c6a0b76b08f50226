"""Save and resume of a GRPO run: ``<run>/checkpoints/step_<N>`` in the sharded format (with the
policy as a Hugging Face folder beside it when ``trainer.save_hf``), and the run's latest
checkpoint loaded back, the sharded format on any number of ranks, agentloop 0.3's
single-file format on the number of ranks that wrote it.

The trainer decides what its own state is (step, data position, history, the asynchronous
driver's open groups) and applies it after a load; this module decides where and how it is
stored. Every function here is a collective under FSDP: every rank calls it.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

CHECKPOINTS_DIR = "checkpoints"
"""The run folder's checkpoint folder."""


def save_run_checkpoint(run_dir: str | Path, step: int, model: Any, optimizer: Any, state: dict[str, Any], *,
                        tokenizer: Any = None, save_hf: bool = False, hf_max_shard_bytes: int = 0,
                        rank: int = 0) -> Path:
    """Checkpoint a run at ``step``: model and optimizer shards (each rank writes its own),
    ``state`` (plain types: the trainer's step-independent state), RNG states, and with
    ``save_hf`` the policy as a Hugging Face folder (``step_<N>/hf``, written by rank 0).

    Returns:
        The step folder.
    """
    from agentloop_trainer.checkpoint.common import HF_DIR
    from agentloop_trainer.checkpoint.sharded import save_sharded_checkpoint

    export: Callable[[Path], None] | None = None
    if save_hf:
        from agentloop_trainer.checkpoint.hf_folder import write_hf_folder

        def write_hf(folder: Path) -> None:
            write_hf_folder(model, tokenizer, folder / HF_DIR, max_shard_bytes=hf_max_shard_bytes, write=rank == 0)

        export = write_hf

    return save_sharded_checkpoint(Path(run_dir) / CHECKPOINTS_DIR, step, model, optimizer, state, export=export)


def load_run_checkpoint(run_dir: str | Path, mode: str, model: Any, optimizer: Any,
                        world_size: int = 1) -> tuple[Path, dict[str, Any]] | None:
    """Load the run's latest checkpoint into ``model`` and ``optimizer`` as ``trainer.resume``
    (``mode``) says.

    Returns:
        ``(step folder, trainer state)`` with the state's ``step``, ``rng`` and what the trainer
        saved; None when there is nothing to resume (``never``, or ``auto`` with no checkpoint).
        The RNG states are not yet restored: call
        :func:`~agentloop_trainer.checkpoint.common.set_rng_state` with ``state["rng"]`` once the
        trainer has applied the rest.

    Raises:
        CheckpointError: ``must`` with no checkpoint, or a checkpoint that cannot load here.
    """
    from agentloop_trainer.checkpoint.common import checkpoint_to_resume, is_sharded_checkpoint
    from agentloop_trainer.checkpoint.sharded import load_sharded_checkpoint

    path = checkpoint_to_resume(Path(run_dir) / CHECKPOINTS_DIR, mode)
    if path is None:
        return None
    if is_sharded_checkpoint(path):
        return path, load_sharded_checkpoint(path, model, optimizer)
    return path, load_single_file_checkpoint(path, model, optimizer, world_size)


def load_single_file_checkpoint(path: str | Path, model: Any, optimizer: Any, world_size: int = 1) -> dict[str, Any]:
    """Load an agentloop 0.3 checkpoint (full ``model.pt`` and ``optimizer.pt``) on the number
    of ranks that wrote it (its optimizer state is keyed by what that layout keyed it by).

    Returns:
        The trainer state it holds.

    Raises:
        CheckpointError: it was written with another number of ranks (naming the
            ``trainer.fsdp_ranks`` that loads it).
    """
    from agentloop_trainer.checkpoint.common import CheckpointError, load_checkpoint

    model_state, opt_state, state = load_checkpoint(path)
    if int(state.get("world_size", 1)) != world_size:
        raise CheckpointError(
            f"{path} is a single-file checkpoint (agentloop 0.3) written with trainer.fsdp_ranks="
            f"{state.get('world_size', 1)}; it loads only on that many ranks. Resume it once with "
            f"trainer.fsdp_ranks={state.get('world_size', 1)}: the next save writes the sharded format, which "
            "resumes on any number of ranks")
    if world_size > 1:
        from agentloop_trainer.update.fsdp import load_full_train_state

        load_full_train_state(model, optimizer, model_state, opt_state)
    else:
        model.load_state_dict(model_state)
        optimizer.load_state_dict(opt_state)
    return state
