"""Prompts with images for the engine suite's vision checks (:class:`EngineVisionTests`).

The checks need prompts rendered the way a trajectory renders them: each image's EXPANDED
tokens in the prompt ids and the images, processed once, as ``multi_modal_data``. An engine
author provides them with the ``vision_prompt`` hook; by default the suite builds them with
the model's own vision processor (:func:`agentloop_core.vision.load_vision_processor`) when the
engine exposes its tokenizer and a local checkpoint folder.
"""

from __future__ import annotations

import os
import random
from collections.abc import Callable, Mapping, Sequence
from typing import Any

VisionPrompt = Callable[[Sequence[Any], str], tuple[list[int], Mapping[str, Any]]]
"""(images, text) -> (prompt_ids, multi_modal_data): one user message holding ``images`` (decoded
PIL images) then ``text``, rendered with the generation prompt; ``multi_modal_data`` is what
``generate`` takes beside the ids (``{"image": [ImageItem, ...]}``)."""

_CACHE: dict[tuple[str, int], tuple[Any, VisionPrompt | None]] = {}


def model_folder(engine: Any) -> str | None:
    """The local checkpoint folder an engine serves, where it says: ``model_path`` or
    ``model_name`` (HFServer, VLLMServer), or its SGLang engine's ``server_args.model_path``."""
    inner_args = getattr(getattr(engine, "engine", None), "server_args", None)
    for value in (getattr(engine, "model_path", None), getattr(engine, "model_name", None),
                  getattr(inner_args, "model_path", None)):
        if isinstance(value, (str, os.PathLike)) and os.path.isfile(os.path.join(value, "config.json")):
            return os.fspath(value)
    return None


def vision_prompt_for(folder: str, tokenizer: Any) -> VisionPrompt | None:
    """A ``vision_prompt`` hook rendering with ``folder``'s vision processor and ``tokenizer``'s
    chat template; None for a text-only checkpoint.

    Raises:
        ValueError: a vision checkpoint of a family no vision processor handles.
    """
    key = (folder, id(tokenizer))
    if key not in _CACHE:
        from agentloop_core.tokenization import ChatRenderer, Trajectory
        from agentloop_core.vision import load_vision_processor

        processor = load_vision_processor(folder, tokenizer)
        hook: VisionPrompt | None = None
        if processor is not None:
            renderer = ChatRenderer(tokenizer, vision=processor)

            def render(images: Sequence[Any], text: str) -> tuple[list[int], Mapping[str, Any]]:
                parts = [*({"type": "image", "image": image} for image in images), {"type": "text", "text": text}]
                trajectory = Trajectory(renderer, [{"role": "user", "content": parts}])
                return trajectory.context_ids, {"image": list(trajectory.image_items)}

            hook = render

        # The tokenizer is kept with the entry, so its id names it as long as the entry lives.
        _CACHE[key] = (tokenizer, hook)
    return _CACHE[key][1]


def default_vision_prompt(engine: Any) -> VisionPrompt | None:
    """The ``vision_prompt`` hook the suite builds itself: from the engine's ``tokenizer`` and
    :func:`model_folder`; None when the engine exposes neither or serves a text-only model."""
    tokenizer = getattr(engine, "tokenizer", None)
    folder = model_folder(engine)
    if tokenizer is None or folder is None:
        return None
    return vision_prompt_for(folder, tokenizer)


def noise_image(width: int, height: int, seed: int) -> Any:
    """An RGB image of seeded uniform noise (Pillow only): two seeds give two images as unlike
    as images get, which any vision-language model reads differently."""
    from PIL import Image

    return Image.frombytes("RGB", (width, height), random.Random(seed).randbytes(width * height * 3))
