"""Weights over HTTP: the body of ``POST /update_weights``, one safetensors archive of named
tensors, written by :class:`~agentloop_engines.fleet.http_client.EngineHTTPClient` and read by the engine
server (:mod:`agentloop_engines.serving.server`). Both need torch and safetensors (the ``[hf]`` extra).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

__all__ = ["load_safetensors", "serialize_weights"]


def serialize_weights(named_tensors: Iterable[tuple[str, Any]] | Mapping[str, Any]) -> bytes:
    """Pack named tensors into one safetensors archive (the ``POST /update_weights`` body).

    Tensors are detached, moved to the CPU and made contiguous. safetensors refuses tensors
    that share storage (tied embeddings, views of one buffer), so every tensor after the first
    on a storage is copied; a repeated name keeps its last tensor, as loading in order would.

    Raises:
        ImportError: without torch and safetensors.
    """
    try:
        import torch
        from safetensors.torch import save
    except ImportError as exc:
        raise ImportError(f'update_weights over HTTP needs {exc.name}: pip install "agentloop-engines[hf]"') from exc
    items = named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors
    tensors: dict[str, Any] = {}
    storages: set[int] = set()
    for name, value in items:
        t = torch.as_tensor(value).detach().cpu().contiguous()
        if t.untyped_storage().data_ptr() in storages:
            t = t.clone()
        storages.add(t.untyped_storage().data_ptr())
        tensors[str(name)] = t
    return save(tensors)


def load_safetensors(body: bytes) -> dict[str, Any]:
    """The named tensors of a ``POST /update_weights`` body (the server side).

    Raises:
        ValueError: an empty body or one that is not a safetensors archive.
        ImportError: without safetensors.
    """
    try:
        from safetensors.torch import load
    except ImportError as exc:
        raise ImportError(f'POST /update_weights needs {exc.name}: pip install "agentloop-engines[hf]"') from exc
    if not body:
        raise ValueError("POST /update_weights has an empty body; send safetensors.torch.save(named_tensors)")
    try:
        return load(body)
    except Exception as exc:  # safetensors raises its own error type for a malformed archive
        raise ValueError(f"POST /update_weights body is not a safetensors archive: {exc}") from exc
