"""Vision-language checkpoints in HFServer: loading them, and prefilling a prompt with images.

A row whose prompt holds images is prefilled on its own: its image tokens' embeddings come
from the vision tower (``pixel_values``, ``image_grid_thw`` from each
:class:`~agentloop_core.vision.ImageItem`, computed once where the image entered the
trajectory), and a model with 3-D rotary positions (M-RoPE: the Qwen-VL family) gets them
from its own ``get_rope_index``. From then on the row decodes like any other in the batch: the
next text position is ``max(position) + 1``, the same on all three axes, so its integer
``next_pos`` (shifted by the row's ``rope_delta``) is all a decode step needs, and rows with
and without images share every decode step.
"""

from __future__ import annotations

from typing import Any

import torch

from agentloop_core.vision.processor import ImageItem, image_token_runs

__all__ = ["image_token_id", "load_model", "prefill_inputs", "text_config"]


def load_model(path: str, dtype: torch.dtype) -> Any:
    """A checkpoint folder as a generating model: ``AutoModelForCausalLM``, or for a
    vision-language checkpoint that transformers files under image-text-to-text (Qwen2-VL,
    Qwen2.5-VL, Qwen3-VL, Idefics3), ``AutoModelForImageTextToText``."""
    import transformers
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
    )

    config = transformers.AutoConfig.from_pretrained(path)
    model_type = getattr(config, "model_type", None)
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and model_type in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES:
        return transformers.AutoModelForImageTextToText.from_pretrained(path, dtype=dtype)
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype)


def text_config(model: Any) -> Any:
    """The config of ``model``'s language model: its own for a causal LM, the text part of a
    vision-language model's (where ``max_position_embeddings`` and ``eos_token_id`` live)."""
    config = model.config
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def image_token_id(model: Any) -> int | None:
    """The id of the image placeholder token a vision-language model reads, or None for a
    text-only model (no ``vision_config`` or no ``image_token_id``)."""
    config = getattr(model, "config", None)
    if config is None or getattr(config, "vision_config", None) is None:
        return None
    token = getattr(config, "image_token_id", None)
    if token is None:
        token = getattr(config, "image_token_index", None)
    return None if token is None else int(token)


def prefill_inputs(model: Any, prompt_ids: list[int], images: tuple[ImageItem, ...], token_id: int,
                   device: torch.device) -> tuple[dict[str, Any], int]:
    """The keyword arguments of one row's prefill forward with its images, and the position its
    first generated token takes (``max(position) + 1``, which M-RoPE models put below the
    prompt length).

    Raises:
        ValueError: when the prompt's image tokens are not the images' token counts (a prompt
            rendered for other images, or image tokens typed as text).
    """
    import numpy as np

    image_token_runs(prompt_ids, images, token_id)  # each image's run of tokens, in order, or ValueError
    ids = torch.tensor([prompt_ids], dtype=torch.long, device=device)
    mask = torch.ones_like(ids)
    keys = images[0].features.keys()
    features = {k: torch.from_numpy(np.concatenate([np.asarray(i.features[k]) for i in images])).to(device)
                for k in keys}
    if "pixel_values" in features:
        features["pixel_values"] = features["pixel_values"].to(model.dtype)
    kwargs: dict[str, Any] = {"input_ids": ids, "attention_mask": mask, **features}
    next_position = len(prompt_ids)
    rope_index = getattr(getattr(model, "model", None), "get_rope_index", None)
    if rope_index is not None and "image_grid_thw" in features:
        token_types = (ids == token_id).to(torch.int32)
        positions, _ = rope_index(ids, mm_token_type_ids=token_types, image_grid_thw=features["image_grid_thw"],
                                  attention_mask=mask)
        kwargs["position_ids"] = positions
        next_position = int(positions.max()) + 1
    return kwargs, next_position
