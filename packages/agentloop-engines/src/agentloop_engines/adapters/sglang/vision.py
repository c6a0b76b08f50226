"""What :class:`~agentloop_engines.adapters.sglang.server.SGLangServer` reads about a vision-language
model: its image placeholder id, its vision patch size, and the placeholder ids it bans from
sampling (:mod:`agentloop_engines.adapters.placeholders`), from SGLang's model config or else the
checkpoint's ``config.json``."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from agentloop_engines.adapters.dtypes import local_checkpoint_folder
from agentloop_engines.adapters.placeholders import placeholder_token_ids

__all__ = ["SGLangVision", "checkpoint_config", "sglang_vision"]


@dataclass(frozen=True)
class SGLangVision:
    """A served model's vision facts; all empty for a text-only model."""

    image_token_id: int | None
    """The image placeholder's id (None: text only)."""
    patch_size: int | None
    """The vision tower's patch size in pixels (None: unknown or text only)."""
    banned_token_ids: tuple[int, ...]
    """Image and video placeholder ids, never sampled."""


def checkpoint_config(model_path: str | None) -> dict[str, Any]:
    """The checkpoint's ``config.json`` (empty when it cannot be read here)."""
    folder = local_checkpoint_folder(model_path) if model_path else None
    try:
        return json.loads((folder / "config.json").read_text()) if folder is not None else {}
    except (OSError, ValueError):
        return {}


def sglang_vision(model_config: Any, config: Mapping[str, Any], image_token_id: int | None,
                  vocab_size: int) -> SGLangVision:
    """The vision facts of the model SGLang serves.

    Args:
        model_config: SGLang's ``tokenizer_manager.model_config`` (its ``hf_config`` and
            ``is_multimodal``), or None.
        config: The checkpoint's ``config.json`` (:func:`checkpoint_config`), where SGLang's
            model config says nothing.
        image_token_id: The image placeholder's id when the caller knows it (a stand-in engine);
            None: read from the configs.
        vocab_size: The served vocabulary size (ids past it are not banned: nothing samples them).
    """
    hf = getattr(model_config, "hf_config", None)
    vision = getattr(hf, "vision_config", None) or config.get("vision_config")
    if image_token_id is None and getattr(model_config, "is_multimodal", vision is not None):
        image_token_id = next((t for t in (getattr(hf, "image_token_id", None), config.get("image_token_id"),
                                           getattr(hf, "image_token_index", None), config.get("image_token_index"))
                               if t is not None), None)
    if image_token_id is None:
        return SGLangVision(None, None, ())
    patch = vision.get("patch_size") if isinstance(vision, Mapping) else getattr(vision, "patch_size", None)
    banned = {*placeholder_token_ids(hf, vocab_size), *placeholder_token_ids(config, vocab_size), int(image_token_id)}
    return SGLangVision(int(image_token_id), None if patch is None else int(patch),
                        tuple(sorted(t for t in banned if 0 <= t < vocab_size)))
