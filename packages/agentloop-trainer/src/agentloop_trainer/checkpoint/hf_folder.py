"""The policy as a Hugging Face folder: ``config.json``, ``generation_config.json``, safetensors
weights (sharded with ``model.safetensors.index.json`` past ``max_shard_bytes``) and the
tokenizer, what ``AutoModelForCausalLM.from_pretrained``, vLLM and ``agentloop eval`` load.

The weights come from :func:`~agentloop_trainer.update.weights.iter_policy_weights`: full tensors with the
base model's names, LoRA merged, gathered one bucket at a time under FSDP, so writing the folder
holds at most one bucket and one shard beyond the model, never a full copy of it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"


def _architecture(model: Any) -> str:
    """The transformers class name of the policy (FSDP2 subclasses it as ``FSDP<name>``)."""
    from agentloop_trainer.update.weights import unwrap_policy

    for cls in type(unwrap_policy(model)).__mro__:
        if cls.__module__.startswith("transformers."):
            return cls.__name__
    return type(unwrap_policy(model)).__name__


def write_hf_folder(model: Any, tokenizer: Any, out: str | Path, max_shard_bytes: int, write: bool = True) -> None:
    """Write ``model`` (plain, peft or FSDP2-sharded) to ``out`` as a Hugging Face folder.

    A collective under FSDP: every rank calls it and iterates the weights to the end; only the
    rank with ``write`` writes. A failed write does not stop the iteration (the other ranks would
    wait forever in the next gather); it is raised once every weight went by.

    Args:
        model: The policy.
        tokenizer: Saved alongside (None: no tokenizer files).
        out: The folder (created).
        max_shard_bytes: Weights past this size are split into ``model-0000k-of-0000n.safetensors``
            files and an index; a single tensor larger than it is a file on its own.
        write: Whether this rank writes (rank 0).
    """
    import copy

    from transformers import GenerationConfig

    from agentloop_trainer.update.weights import (
        DEFAULT_BUCKET_BYTES,
        base_model_config,
        iter_policy_weights,
        unwrap_policy,
    )

    if max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be positive, not {max_shard_bytes}")
    out = Path(out)
    config = copy.deepcopy(base_model_config(model))
    writer = _ShardWriter(out, max_shard_bytes) if write else None
    failure: BaseException | None = None
    dtypes: set[Any] = set()
    for bucket in iter_policy_weights(model, bucket_bytes=min(max_shard_bytes, DEFAULT_BUCKET_BYTES),
                                      include_tied=False):
        if writer is None or failure is not None:
            continue
        try:
            for name, tensor in bucket:  # a tied head is not in it: from_pretrained ties it back
                if tensor.is_floating_point():
                    dtypes.add(tensor.dtype)
                writer.add(name, tensor)
        except Exception as exc:  # raised below, once the collective is over
            failure = exc
    if writer is None:
        return
    if failure is not None:
        raise failure
    writer.close()
    if len(dtypes) == 1:
        config.dtype = next(iter(dtypes))
    if not getattr(config, "architectures", None):
        config.architectures = [_architecture(model)]
    config.save_pretrained(out)
    generation = getattr(unwrap_policy(model), "generation_config", None)
    (generation or GenerationConfig.from_model_config(config)).save_pretrained(out)
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    _copy_processor_files(config, out)


PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json", "video_preprocessor_config.json")
"""A vision-language checkpoint's processor settings, which no weight or tokenizer file holds."""


def _copy_processor_files(config: Any, out: Path) -> None:
    """Carry the image processor's settings from the folder the policy was loaded from
    (``config._name_or_path``) into the exported folder, so it loads as the same
    vision-language model (``load_vision_processor``, vLLM) with the same image tokens."""
    import shutil

    source = getattr(config, "_name_or_path", None)
    if not source or not Path(source).is_dir() or Path(source).resolve() == out.resolve():
        return
    for name in PROCESSOR_FILES:
        if (Path(source) / name).is_file() and not (out / name).exists():
            shutil.copy2(Path(source) / name, out / name)


def final_hf_folder(model: Any, tokenizer: Any, run_dir: str | Path, step: int, max_shard_bytes: int,
                    rank: int = 0) -> Path:
    """The policy at the end of a run as a Hugging Face folder: the ``hf`` folder of the
    checkpoint of ``step`` when it has one (``trainer.save_freq`` and ``trainer.save_hf``), else
    ``<run_dir>/final/hf`` (weights and tokenizer, no optimizer state), written now. A
    collective under FSDP: every rank calls it and gets the same answer (rank 0 decides).

    Returns:
        The folder (what ``agentloop eval`` and ``from_pretrained`` load).
    """
    import shutil

    from agentloop_trainer.checkpoint.common import HF_DIR
    from agentloop_trainer.update.fsdp import broadcast_object

    saved = Path(run_dir) / "checkpoints" / f"step_{step}" / HF_DIR
    found = broadcast_object((saved / "config.json").is_file() if rank == 0 else None)
    if found:
        return saved
    out = Path(run_dir) / "final" / HF_DIR
    if rank == 0 and out.exists():
        shutil.rmtree(out)  # an earlier run's shards must not mix with these
    write_hf_folder(model, tokenizer, out, max_shard_bytes=max_shard_bytes, write=rank == 0)
    return out


class _ShardWriter:
    """Safetensors files of at most ``max_bytes`` each (one tensor may exceed it alone), named as
    ``save_pretrained`` names them once their count is known."""

    def __init__(self, out: Path, max_bytes: int) -> None:
        out.mkdir(parents=True, exist_ok=True)
        self.out, self.max_bytes = out, max_bytes
        self.parts: list[tuple[Path, list[str]]] = []
        self.current: dict[str, Any] = {}
        self.storages: set[int] = set()
        self.size = self.total = 0

    def add(self, name: str, tensor: Any) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        if self.current and self.size + nbytes > self.max_bytes:
            self._flush()
        tensor = tensor.detach().contiguous()
        if tensor.untyped_storage().data_ptr() in self.storages:
            tensor = tensor.clone()  # safetensors refuses tensors sharing memory (an untied view of a tied weight)
        self.storages.add(tensor.untyped_storage().data_ptr())
        self.current[name] = tensor
        self.size += nbytes
        self.total += nbytes

    def _flush(self) -> None:
        from safetensors.torch import save_file

        path = self.out / f".part-{len(self.parts):05d}.safetensors"
        save_file(self.current, str(path), metadata={"format": "pt"})
        self.parts.append((path, list(self.current)))
        self.current, self.storages, self.size = {}, set(), 0

    def close(self) -> None:
        if self.current or not self.parts:
            self._flush()
        n = len(self.parts)
        if n == 1:
            os.replace(self.parts[0][0], self.out / WEIGHTS_NAME)
            return
        weight_map = {}
        for i, (path, names) in enumerate(self.parts, start=1):
            final = f"model-{i:05d}-of-{n:05d}.safetensors"
            os.replace(path, self.out / final)
            weight_map.update(dict.fromkeys(names, final))
        index = {"metadata": {"total_size": self.total}, "weight_map": weight_map}
        (self.out / INDEX_NAME).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
