"""The dtype an engine runs a checkpoint in when its caller names none.

``HFServer`` loads a checkpoint in float32. vLLM's and SGLang's default, ``dtype="auto"``, keeps a
16-bit checkpoint's dtype but runs a float32 checkpoint in a 16-bit type (SGLang: float16,
measured on a real build; the resumed log-probs of a partial rollout were then 0.126 nats off
the float32 forward pass). ``VLLMServer`` and ``SGLangServer`` built from a path therefore pass
:func:`default_engine_dtype` unless the caller gives ``dtype``, so all three adapters run a
float32 checkpoint in float32 and a 16-bit one as the engine would (HFServer: upcast to float32).
"""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["checkpoint_dtype", "default_engine_dtype", "local_checkpoint_folder"]


def local_checkpoint_folder(model_path: str | Path) -> Path | None:
    """``model_path`` if it is a folder, else its copy in the Hugging Face cache, else None
    (nothing is downloaded)."""
    folder = Path(model_path)
    if folder.is_dir():
        return folder
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(str(model_path), local_files_only=True))
    except Exception:  # noqa: BLE001 - not cached here, or no huggingface_hub
        return None


def checkpoint_dtype(model_path: str | Path) -> str | None:
    """The dtype a checkpoint's ``config.json`` declares (``dtype``, or the older ``torch_dtype``;
    float32 when it declares none, as transformers, vLLM and SGLang all read it), or None when
    the config cannot be read."""
    folder = local_checkpoint_folder(model_path)
    if folder is None:
        return None
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return None
    declared = config.get("dtype") or config.get("torch_dtype") or "float32"
    return str(declared).removeprefix("torch.")


def default_engine_dtype(model_path: str | Path) -> str | None:
    """``"float32"`` for a float32 checkpoint (so vLLM/SGLang do not downcast it), else None:
    the engine's ``"auto"``, which keeps a 16-bit checkpoint's dtype (or an unreadable config's
    engine default)."""
    return "float32" if checkpoint_dtype(model_path) == "float32" else None
