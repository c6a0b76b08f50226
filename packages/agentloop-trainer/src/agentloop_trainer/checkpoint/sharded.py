"""The trainer's checkpoint format: model and optimizer state written with
``torch.distributed.checkpoint`` (DCP), each rank its own shards, resumable on any number of
ranks, with nothing unpickled on load.

Layout of ``<run>/checkpoints/step_<N>/`` (see the trainer README):

- ``state/``: the model's and the optimizer's tensors as safetensors, one file per rank holding
  that rank's shards (``shard-<rank+1>-model-00001-of-00001.safetensors``); no rank gathers the
  full state. Each file's header records where its chunks sit in the full tensors, so a run
  resumes on any number of ranks (DCP reads the chunks each rank's new shards overlap).
- ``trainer_state.pt``: everything else (step, data position, RNG, metrics history, the
  optimizer's param groups, the world size, and the manifest: every state file with its size,
  every tensor with its full shape and dtype), as plain types.
- ``hf/``: whatever the ``export`` callback writes (the trainer's Hugging Face folder,
  :mod:`agentloop_trainer.checkpoint.hf_folder`), committed with the rest.

Safety on top of :mod:`agentloop_trainer.checkpoint.common`'s:

- DCP's own ``FileSystemReader`` pickle-loads a ``.metadata`` file, so it is not used;
  ``HuggingFaceStorageReader`` reads the sharding from the safetensors headers (JSON).
- Before DCP reads a byte, the state files are checked against the manifest (no file missing,
  extra, resized or a symlink) and every header against the tensors' full shapes (each chunk
  inside its tensor, the chunks tiling it exactly): a tampered or incomplete checkpoint is a
  :class:`~agentloop_trainer.checkpoint.common.CheckpointError` naming the fix, never a silently
  half-loaded model.
- Every rank writes into one temporary step folder; rank 0 commits it (fsync, rename, ``latest``)
  once all are done and tells the others whether it could.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from agentloop_trainer.checkpoint.common import (
    STATE_DIR,
    CheckpointError,
    _commit,
    _fsync,
    _load_plain,
    _plain,
    rng_state,
)

SHARDED_FORMAT = 2
"""``trainer_state["format"]`` of a sharded checkpoint (0.3's single-file one has none)."""


def _fsync_tree(folder: Path) -> None:
    """fsync every file and folder under ``folder`` (and ``folder`` itself), deepest first."""
    for dirpath, _, filenames in os.walk(folder, topdown=False):
        for name in filenames:
            _fsync(Path(dirpath, name))
        _fsync(Path(dirpath))


def _dist() -> tuple[int, int]:
    """(rank, world size) of the default process group; (0, 1) without one."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


@contextlib.contextmanager
def _single_process_quiet() -> Iterator[None]:
    """DCP warns that it "assumes" a single process even when told so (``no_dist=True``)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


_WRAPPER_SEGMENTS = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod.")
"""Module-wrapper segments that state-dict keys leave out (as DCP's ``get_state_dict`` does)."""


def _tied_names(model: Any) -> dict[str, str]:
    """Each tied parameter's state-dict key -> the key of the first parameter it is tied to
    (``lm_head.weight`` -> ``model.embed_tokens.weight``). Structural, so every rank agrees."""
    first: dict[int, str] = {}
    tied = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        for segment in _WRAPPER_SEGMENTS:
            name = name.replace(segment, "")
        if id(param) in first:
            tied[name] = first[id(param)]
        else:
            first[id(param)] = name
    return tied


def _split_state(model: Any, model_state: dict[str, Any],
                 optim_state: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """DCP's flat tensor dict (``model.<fqn>``, ``optim.<fqn>.<name>``; a tied parameter once)
    and the optimizer's non-tensor rest (param groups, non-tensor per-parameter entries)."""
    import torch

    tied = _tied_names(model)
    tensors: dict[str, Any] = {}
    rest: dict[str, Any] = {"param_groups": optim_state.get("param_groups", []), "state": {}}
    for fqn, value in model_state.items():
        if not isinstance(value, torch.Tensor):
            raise CheckpointError(f"model state entry {fqn!r} is a {type(value).__name__}, not a tensor; the "
                                  "sharded checkpoint stores model tensors only")
        if tied.get(fqn) not in model_state:  # safetensors stores memory once: a tied copy is left out
            tensors[f"model.{fqn}"] = value
    for fqn, entries in optim_state.get("state", {}).items():
        for name, value in entries.items():
            if isinstance(value, torch.Tensor):
                tensors[f"optim.{fqn}.{name}"] = value
            else:
                rest["state"].setdefault(fqn, {})[name] = value
    return tensors, rest


def _join_state(model: Any, tensors: dict[str, Any], model_state: dict[str, Any], optim_state: dict[str, Any],
                rest: dict[str, Any]) -> None:
    """Put DCP's loaded flat tensors and the saved non-tensor rest back into the nested dicts."""
    tied = _tied_names(model)
    for fqn in model_state:
        key = f"model.{fqn}" if f"model.{fqn}" in tensors else f"model.{tied[fqn]}"
        model_state[fqn] = tensors[key]
    for fqn, entries in optim_state.get("state", {}).items():
        for name in entries:
            if f"optim.{fqn}.{name}" in tensors:
                entries[name] = tensors[f"optim.{fqn}.{name}"]
        entries.update(rest["state"].get(fqn, {}))
    optim_state["param_groups"] = rest["param_groups"]


def _manifest(tensors: dict[str, Any]) -> dict[str, list]:
    """Full shape and dtype of every tensor (a DTensor's ``shape`` is the full one)."""
    return {key: [list(t.shape), str(t.dtype).removeprefix("torch.")] for key, t in tensors.items()}


def save_sharded_checkpoint(root: str | Path, step: int, model: Any, optimizer: Any, trainer_state: dict[str, Any],
                            export: Callable[[Path], None] | None = None) -> Path:
    """Write ``<root>/step_<step>`` atomically and point ``<root>/latest`` at it. A collective:
    every rank calls it; each writes its own shards of the model and optimizer.

    Args:
        root: The run's checkpoint folder (on a filesystem every rank sees).
        step: Steps completed.
        model: The policy, plain or FSDP2-sharded.
        optimizer: Its optimizer.
        trainer_state: Data position, metrics history: tensors and plain types only (rank 0's is
            written).
        export: Called on every rank with the temporary step folder, after the state is written
            and before the folder is committed (the Hugging Face folder goes in here).

    Returns:
        The checkpoint folder.

    Raises:
        CheckpointError: something in the states is not a tensor or plain type (nothing is
            written), or rank 0 cannot see every rank's files.
    """
    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageWriter
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.checkpoint.state_dict_saver import save

    rank, world = _dist()
    model_state, optim_state = get_state_dict(model, optimizer)  # this rank's shards, no gathering
    tensors, rest = _split_state(model, model_state, optim_state)
    # Every rank converts (and would fail) alike, so no rank is left waiting in a collective.
    state = _plain({"step": step, "rng": rng_state(), **trainer_state, "format": SHARDED_FORMAT,
                    "world_size": world, "optimizer": rest, "tensors": _manifest(tensors)}, "trainer_state")
    root = Path(root)
    tmp = None
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=f".step_{step}.", dir=root)
    if world > 1:
        box = [tmp]
        dist.broadcast_object_list(box, src=0)
        tmp = box[0]
    assert tmp is not None, "rank 0 made the folder and every other rank got its name"
    tmp = Path(tmp)
    error = None
    try:
        with _single_process_quiet():
            save(tensors, storage_writer=HuggingFaceStorageWriter(str(tmp / STATE_DIR), save_distributed=True),
                     no_dist=world == 1)
        try:
            if export is not None:
                export(tmp)
        except Exception as exc:  # this rank's own writes: the others learn of it below instead of hanging
            error = f"rank {rank}: {type(exc).__name__}: {exc}"
        mine = ({p.name: p.stat().st_size for p in (tmp / STATE_DIR).glob(f"shard-{rank + 1:05d}-*")}, error)
        reports = [mine]
        if world > 1:
            reports = [mine] * world  # one slot per rank: all_gather_object overwrites each
            dist.all_gather_object(reports, mine)
        error = next((e for _, e in reports if e is not None), None)
        if rank == 0 and error is None:
            try:
                files = {name: size for written, _ in reports for name, size in written.items()}
                unseen = [n for n, size in files.items() if not (tmp / STATE_DIR / n).is_file()
                          or (tmp / STATE_DIR / n).stat().st_size != size]
                if unseen:
                    raise CheckpointError(f"rank 0 does not see the state files {unseen} other ranks wrote under "
                                          f"{tmp}; put trainer.output_dir (or trainer.run_dir) on a filesystem "
                                          "every node shares")
                torch.save({**state, "files": files}, tmp / "trainer_state.pt")
                _fsync_tree(tmp)
                _commit(root, step, tmp)
            except Exception as exc:
                error = f"rank 0: {type(exc).__name__}: {exc}"
        if world > 1:
            box = [error]
            dist.broadcast_object_list(box, src=0)
            error = box[0]
    finally:
        if rank == 0 and tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    if error is not None:
        raise CheckpointError(f"checkpoint step {step} was not saved ({error}); the previous checkpoint, if any, "
                              "is intact")
    return root / f"step_{step}"


def _check_state_files(path: Path, state: dict[str, Any]) -> None:
    """The state files are exactly the manifest's, and their headers tile every tensor.

    Raises:
        CheckpointError: naming the file and the fix.
    """
    from safetensors import safe_open

    folder = path / STATE_DIR
    fix = (f"the checkpoint {path} is incomplete or was altered; restore it from where it was copied, or delete "
           "it and resume from an earlier step_<N> (edit the latest pointer next to it)")
    files, tensors = state.get("files"), state.get("tensors")
    if not isinstance(files, dict) or not isinstance(tensors, dict):
        raise CheckpointError(f"{path / 'trainer_state.pt'} has no manifest of the state files; {fix}")
    present = {p.name: p for p in folder.iterdir()}
    for name, p in present.items():
        if p.is_symlink() or not p.is_file():
            raise CheckpointError(f"{p} is a symlink or not a file; state files must be plain files: {fix}")
        if name not in files:
            raise CheckpointError(f"{p} is not one of the checkpoint's state files; remove it, or {fix}")
    for name, size in files.items():
        if name not in present:
            raise CheckpointError(f"{folder / name} is missing: {fix}")
        if present[name].stat().st_size != size:
            raise CheckpointError(f"{folder / name} has {present[name].stat().st_size} bytes, not the {size} "
                                  f"written: {fix}")
    chunks: dict[str, list[tuple[list[int], list[int]]]] = {key: [] for key in tensors}
    for name in files:
        try:
            with safe_open(str(folder / name), framework="pt") as f:
                sharding = json.loads((f.metadata() or {})["DCP_SHARDING_INFO"])
                for key in f.keys():  # noqa: SIM118 (safetensors' safe_open handle is not iterable)
                    piece = f.get_slice(key)
                    shape, dtype = list(piece.get_shape()), piece.get_dtype()
                    offsets = sharding[key]["saved_offsets"]
                    if key not in chunks:
                        raise CheckpointError(f"{folder / name} holds {key!r}, which the checkpoint does not list: "
                                              f"{fix}")
                    full, want_dtype = tensors[key]
                    if (len(offsets) != len(full) or len(shape) != len(full)
                            or any(not isinstance(o, int) or o < 0 or o + n > m
                                   for o, n, m in zip(offsets, shape, full, strict=True))):
                        raise CheckpointError(f"{folder / name}: the chunk of {key!r} at offsets {offsets} with "
                                              f"shape {shape} is outside the tensor's shape {full}: {fix}")
                    if _DTYPES.get(dtype) != want_dtype:
                        raise CheckpointError(f"{folder / name}: {key!r} is {dtype}, not {want_dtype}: {fix}")
                    chunks[key].append((offsets, shape))
        except CheckpointError:
            raise
        except Exception as exc:  # safetensors' own header checks, a missing key in the sharding info
            raise CheckpointError(f"{folder / name} is not a readable state file ({type(exc).__name__}: "
                                  f"{str(exc)[:200]}): {fix}") from None
    for key, (full, _) in tensors.items():
        if not _tiles(full, chunks[key]):
            raise CheckpointError(f"the state files do not hold all of {key!r} exactly once (chunks "
                                  f"{chunks[key]} of shape {full}): {fix}")


_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
           "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool"}
"""safetensors dtype names -> torch's."""


def _tiles(full: list[int], chunks: list[tuple[list[int], list[int]]]) -> bool:
    """Whether the boxes ``(offsets, shape)`` (all inside ``full``) cover it exactly once."""
    import math

    boxes = [(o, s) for o, s in chunks if math.prod(s) > 0]
    for i, (o1, s1) in enumerate(boxes):
        for o2, s2 in boxes[i + 1:]:
            if all(a < c + m and c < a + n for a, n, c, m in zip(o1, s1, o2, s2, strict=True)):
                return False
    return sum(math.prod(s) for _, s in boxes) == math.prod(full)


def load_sharded_checkpoint(path: str | Path, model: Any, optimizer: Any) -> dict[str, Any]:
    """Load a sharded checkpoint into ``model`` and ``optimizer`` (plain or FSDP2-sharded, on any
    number of ranks) and return its trainer state (RNG not yet restored: call
    :func:`set_rng_state` with ``trainer_state["rng"]``). A collective: every rank calls it.

    Raises:
        FileNotFoundError: the folder is not a complete checkpoint.
        CheckpointError: a file is missing, extra, altered or holds something other than
            tensors and plain types; or the checkpoint is of another model or optimizer setup.
    """
    from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageReader
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.checkpoint.state_dict_loader import load

    path = Path(path)
    if not (path / "trainer_state.pt").exists() or not (path / STATE_DIR).is_dir():
        raise FileNotFoundError(f"{path} is not a complete checkpoint (no trainer_state.pt or state/)")
    state = _load_plain(path / "trainer_state.pt")
    if not isinstance(state, dict) or state.get("format") != SHARDED_FORMAT:
        raise CheckpointError(f"{path / 'trainer_state.pt'} is not the trainer state of a sharded checkpoint "
                              f"(format {SHARDED_FORMAT}); was it written by another agentloop version?")
    _check_state_files(path, state)
    model_state, optim_state = get_state_dict(model, optimizer)
    tensors, _ = _split_state(model, model_state, optim_state)
    saved = state["tensors"]
    if set(saved) != set(tensors) or any(list(t.shape) != saved[k][0] for k, t in tensors.items()):
        missing, extra = sorted(set(tensors) - set(saved)), sorted(set(saved) - set(tensors))
        raise CheckpointError(
            f"{path} holds the state of another model or optimizer setup (missing {missing[:5]}, not expected "
            f"{extra[:5]}, or other shapes); resume with the model.* and actor settings (e.g. LoRA) that wrote it, "
            "or start a new run (trainer.resume=never) from its hf/ folder")
    with _single_process_quiet():
        load(tensors, storage_reader=HuggingFaceStorageReader(str(path / STATE_DIR)), no_dist=_dist()[1] == 1)
    _join_state(model, tensors, model_state, optim_state, state["optimizer"])
    set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optim_state)
    return state
