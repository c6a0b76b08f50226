"""The tiny tokenizer with Qwen2-VL's vision tokens and a chat template that renders image
parts, and a Qwen2-VL image processor sized for tests: the processor half of the tiny VLM
(``agentloop_engines.testing.tiny_vlm`` adds the model), usable without torch."""

from __future__ import annotations

from importlib import resources
from typing import Any

VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
"""Qwen2-VL's vision special tokens, added after the tiny tokenizer's own."""

MIN_PIXELS = 56 * 56
MAX_PIXELS = 224 * 224


def vision_chat_template() -> str:
    """The tiny tool-calling ChatML template with image parts (``chat_template_vision.jinja``)."""
    return resources.files("agentloop_core.testing").joinpath("chat_template_vision.jinja").read_text()


def add_vision_tokens(tokenizer: Any) -> Any:
    """``tokenizer`` with :data:`VISION_TOKENS` added as special tokens and the vision template
    set (changed in place and returned)."""
    from transformers import AddedToken

    tokenizer.add_special_tokens(
        {"additional_special_tokens": [AddedToken(t, special=True, normalized=False) for t in VISION_TOKENS]},
        replace_extra_special_tokens=False,
    )
    tokenizer.chat_template = vision_chat_template()
    return tokenizer


def tiny_image_processor(min_pixels: int = MIN_PIXELS, max_pixels: int = MAX_PIXELS, patch_size: int = 14) -> Any:
    """Qwen2-VL's image processor (its PIL backend: no torchvision) with ``patch_size`` (14:
    Qwen2-VL and Qwen2.5-VL; 16: Qwen3-VL), merge 2 and images resized to between
    ``min_pixels`` and ``max_pixels``."""
    from transformers import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(size={"shortest_edge": min_pixels, "longest_edge": max_pixels},
                                    patch_size=patch_size, temporal_patch_size=2, merge_size=2)


def tiny_vision_processor(tokenizer: Any | None = None) -> tuple[Any, Any]:
    """``(tokenizer, QwenVLProcessor)``: the tiny tokenizer with vision tokens and its processor."""
    from agentloop_core.testing.tiny_tokenizer import load_tiny_tokenizer
    from agentloop_core.vision.processor import QwenVLProcessor

    tokenizer = add_vision_tokens(tokenizer if tokenizer is not None else load_tiny_tokenizer())
    return tokenizer, QwenVLProcessor(tiny_image_processor(), tokenizer)
