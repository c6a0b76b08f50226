"""Vision-language checkpoints in HFServer: loading them, and prefilling prompts with images.

Rows whose prompts hold images are prefilled together, with any text rows that arrived with
them, in one left-padded forward: the image tokens' embeddings come from the vision tower
(each :class:`~agentloop_core.vision.ImageItem`'s features, computed once where the image
entered the trajectory, concatenated in row order), and a model with 3-D rotary positions
(M-RoPE: the Qwen-VL family) gets each row's positions from its own ``get_rope_index`` over
the padded batch, which skips the padding. From then on a row decodes like any other in the
batch: the next text position is ``max(position) + 1``, the same on all three axes, so its
integer ``next_pos`` (the row's length shifted by its rope delta) is all a decode step needs,
and rows with and without images share every decode step.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from agentloop_core.vision.processor import ImageItem, image_token_runs, stack_features

__all__ = ["concat_features", "image_token_id", "linear_patch_embeddings", "load_model", "prefill_inputs",
           "text_config"]


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


def prefill_inputs(model: Any, prompts: Sequence[Sequence[int]], images: Sequence[Sequence[ImageItem]],
                   token_id: int, *, pad_id: int, device: torch.device) -> tuple[dict[str, Any], list[int]]:
    """The keyword arguments of one prefill forward of several rows, left-padded (rows with
    images and text rows alike), and the position each row's first generated token takes.

    The images' features are concatenated in row order, which is the order of their tokens in
    the flattened batch: the model scatters the vision tower's output into its image tokens in
    that order. Positions count each row's own tokens from 0, as the row would see them alone:
    an M-RoPE model's ``get_rope_index`` skips the masked padding; any other model gets
    ``0..n-1`` after its padding. A row's next position is ``max(position) + 1`` (M-RoPE puts
    it below the row's length; the gap is the row's rope delta).

    Raises:
        ValueError: when a prompt's image tokens are not its images' token counts (a prompt
            rendered for other images, or image tokens typed as text).
    """
    for prompt, items in zip(prompts, images, strict=True):
        image_token_runs(prompt, items, token_id)  # each image's run of tokens, in order, or ValueError
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, prompt in enumerate(prompts):
        ids[i, width - len(prompt):] = torch.tensor(list(prompt), dtype=torch.long)
        mask[i, width - len(prompt):] = 1
    ids, mask = ids.to(device), mask.to(device)
    features = {k: v.to(device) for k, v in concat_features([i for items in images for i in items]).items()}
    if "pixel_values" in features:
        features["pixel_values"] = features["pixel_values"].to(model.dtype)
    kwargs: dict[str, Any] = {"input_ids": ids, "attention_mask": mask, **features}
    rope_index = getattr(getattr(model, "model", None), "get_rope_index", None)
    if rope_index is not None and "image_grid_thw" in features:
        token_types = (ids == token_id).to(torch.int32)
        positions, _ = rope_index(ids, mm_token_type_ids=token_types, image_grid_thw=features["image_grid_thw"],
                                  attention_mask=mask)
        kwargs["position_ids"] = positions
        return kwargs, (positions.amax(dim=(0, 2)) + 1).tolist()
    kwargs["position_ids"] = (mask.cumsum(-1) - 1).clamp(min=0)
    return kwargs, [len(p) for p in prompts]


def concat_features(items: Sequence[ImageItem]) -> dict[str, torch.Tensor]:
    """The images' model inputs in order, as tensors (:func:`~agentloop_core.vision.processor.stack_features`:
    concatenated on the first axis; tiled images padded to common tile sizes, as one row)."""
    return {key: torch.from_numpy(value) for key, value in stack_features(items).items()}


def linear_patch_embeddings(model: Any) -> int:
    """Run each ``Conv3d`` of ``model`` whose kernel is its stride (Qwen-VL's patch embedding:
    each patch is cut to exactly the kernel first) as the matrix product it is, when its input
    is one kernel-sized block per item.

    On CPU (one thread), oneDNN's 3-D convolution takes 24 ms for the 4096 patches of 16
    224 px images, where the same product as a matmul takes 7 ms (results equal to ~4e-6); the
    convolution was the largest part of the tiny Qwen2-VL's vision tower.
    The weights are read at each call, so a weight update or a device move applies as before,
    and parameter names do not change. Any other input shape runs the convolution itself.

    Returns:
        How many convolutions now run as a matrix product.
    """
    import types

    turned = 0
    for module in model.modules():
        if (isinstance(module, torch.nn.Conv3d) and tuple(module.kernel_size) == tuple(module.stride)
                and module.groups == 1 and not any(module.padding) and tuple(module.dilation) == (1, 1, 1)):
            module.forward = types.MethodType(_conv_as_linear, module)
            turned += 1
    return turned


def _conv_as_linear(self: torch.nn.Conv3d, x: torch.Tensor) -> torch.Tensor:
    if x.dim() != 5 or tuple(x.shape[2:]) != tuple(self.kernel_size) or x.shape[1] != self.in_channels:
        return torch.nn.Conv3d.forward(self, x)
    out = torch.nn.functional.linear(x.reshape(x.shape[0], -1), self.weight.reshape(self.out_channels, -1), self.bias)
    return out.reshape(x.shape[0], self.out_channels, 1, 1, 1)
