"""Prompt lengths of dataset rows with images, as the rollout renders them.

A chat template writes one placeholder per image part; the rollout's renderer expands it to the
run of image tokens the model's vision processor makes of the image (hundreds for a photo on
Qwen-VL; tiles and their names between the runs on Idefics3). :func:`image_prompt_lengths`
renders each image row the same way, a :class:`~agentloop_core.tokenization.Trajectory` on a
:class:`~agentloop_core.tokenization.ChatRenderer` with the rollout's tool schemas and the
processor loaded from the tokenizer's folder (as :mod:`agentloop_trainer.rollout.rollouts`
loads it), so ``data.filter_overlong_prompts`` keeps only prompts the rollout can render within
``data.max_prompt_length``.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from agentloop_core.vision.content import IMAGE_PART_TYPES
from agentloop_core.vision.processor import VisionProcessor

__all__ = ["has_images", "image_prompt_lengths", "template_length"]

logger = logging.getLogger(__name__)


def has_images(messages: Sequence[Mapping[str, Any]]) -> bool:
    """Whether any message's content holds an image part."""
    return any(isinstance(m.get("content"), (list, tuple))
               and any(isinstance(p, Mapping) and p.get("type") in IMAGE_PART_TYPES for p in m["content"])
               for m in messages if isinstance(m, Mapping))


def image_prompt_lengths(prompts: Mapping[int, Sequence[Mapping[str, Any]]], tokenizer: Any,
                         tools: list[dict[str, Any]] | None, processor: Any = "auto", name: str = "dataset",
                         image_limits: Any = None) -> dict[int, int]:
    """Tokens of each prompt (by row number) rendered as the rollout renders it: every image
    decoded within ``image_limits`` and expanded to its image tokens.

    Args:
        prompts: The rows' prompts with image parts, by row number.
        tokenizer: The run's tokenizer.
        tools: The rollout's tool schemas.
        processor: The model's vision processor; ``"auto"``: loaded from the tokenizer's folder
            (``name_or_path``); None: a text-only model.
        name: What the rows are, for errors.
        image_limits: The rollout's :class:`~agentloop_core.vision.ImageLimits` (None: the defaults).

    A row whose images only a setting refuses (over ``image_limits``, which a loop may raise) is
    kept, measured as its chat template writes it, with a warning.

    Raises:
        ValueError: the model has no vision processor, or some rows' images cannot be read
            under any settings (corrupt, not an image): the rows and the reasons named.
    """
    from agentloop_core.tokenization import ChatRenderer, Trajectory
    from agentloop_core.vision import ImageError, ImageLimitError, load_vision_processor

    folder = getattr(tokenizer, "name_or_path", None) or ""
    vision: VisionProcessor | None
    if isinstance(processor, str) and processor == "auto":
        vision = load_vision_processor(folder, tokenizer) if folder else None
    else:
        vision = check_processor(processor)
    if vision is None:
        listed = ", ".join(f"row {i}" for i in list(prompts)[:10])
        raise ValueError(
            f"{name}: {len(prompts)} prompts have images ({listed}{', ...' if len(prompts) > 10 else ''}), but the "
            f"model ({folder or 'the tokenizer'}) has no vision processor, so the rollout would fail them on every draw; use a "
            "vision-language model (a checkpoint with a vision_config and preprocessor_config.json, e.g. Qwen2.5-VL) "
            "or remove the images (data.image_key names the column)")
    renderer = ChatRenderer(tokenizer, tools=tools or None, vision=vision)
    lengths: dict[int, int] = {}
    bad: list[tuple[int, str]] = []
    refused: list[tuple[int, str]] = []
    for i, prompt in prompts.items():
        try:
            lengths[i] = len(Trajectory(renderer, list(prompt), image_limits=image_limits).prompt_ids)
        except ImageLimitError as exc:  # a loop may allow it (its own max_image_pixels, ...): kept
            refused.append((i, str(exc)))
            lengths[i] = template_length(tokenizer, prompt, tools)
        except ImageError as exc:
            bad.append((i, str(exc)))
    if refused:
        logger.warning("%s: %d prompts' images are over the default image limits (%s), so their length counts each "
                       "image as its placeholder alone; kept: the rollout's loop checks them against its own "
                       "limits (max_image_pixels, max_image_bytes, max_images)", name, len(refused),
                       "; ".join(f"row {i}: {why}" for i, why in refused[:3]))
    if bad:
        listed = "; ".join(f"row {i}: {why}" for i, why in bad[:10])
        more = f" (and {len(bad) - 10} more)" if len(bad) > 10 else ""
        raise ValueError(f"{name}: {len(bad)} prompts' images cannot be rendered: {listed}{more}; the rollout would "
                         "fail these rows on every draw: fix or remove their images")
    return lengths


def check_processor(processor: Any) -> VisionProcessor | None:
    """``processor`` when it is a :class:`~agentloop_core.vision.VisionProcessor` or None.

    Raises:
        TypeError: anything else, naming how to build one.
    """
    if processor is None or isinstance(processor, VisionProcessor):
        return processor
    raise TypeError(f"processor must be an agentloop_core.vision.VisionProcessor, None or 'auto', got "
                    f"{type(processor).__name__}; build it with agentloop_core.vision.load_vision_processor("
                    "model_folder, tokenizer)")


def template_length(tokenizer: Any, prompt: Sequence[Mapping[str, Any]], tools: list[dict[str, Any]] | None) -> int:
    """Tokens of the prompt as the chat template writes it, with the tool schemas and the
    generation prompt (an image as its one placeholder)."""
    ids = tokenizer.apply_chat_template(list(prompt), tools=tools, tokenize=True, add_generation_prompt=True)
    if isinstance(ids, dict) or hasattr(ids, "keys"):  # BatchEncoding in transformers 5.x
        ids = ids["input_ids"]
    return len(ids)
