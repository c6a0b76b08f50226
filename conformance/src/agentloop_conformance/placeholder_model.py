"""A vision-language checkpoint that always wants to generate an image placeholder, for the
suite's placeholder-ban check (:meth:`EngineVisionTests.test_vision_never_generates_placeholder_tokens`).

An engine must never sample a vision model's image or video placeholder ids: a generated one
makes the trajectory's next prompt hold more placeholders than images, and every engine refuses
that prompt. A randomly initialised model gives placeholders no more mass than any other token,
so the check needs one that prefers them: :func:`placeholder_preferring_checkpoint` copies a
checkpoint and edits two weights so that, at every text position, the image placeholder's logit
leads every ordinary token's by about ``image_margin`` nats and the video placeholder's by about
``video_margin`` (so an engine that bans only the image id is caught too).

How: every token's input embedding gets a large constant in dimension 0, which dominates the
residual stream at text positions (image positions take the vision tower's features instead), so
the final norm's output is nearly a constant positive multiple of dimension 0 there; the
placeholders' output-embedding rows then get extra weight in that dimension. With tied
embeddings (the tiny Qwen-VL models) that is the same matrix.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from agentloop_conformance.vision_prompts import model_folder

__all__ = ["engine_placeholder_ids", "placeholder_ids", "placeholder_preferring_checkpoint"]

_RESIDUAL = 10000.0
"""Dimension 0 of every input embedding: far above what the layers add (a few hundred at most
in the tiny Qwen-VL models; at 1000 the margins came out at half the asked size)."""


def placeholder_ids(config: Any) -> tuple[int | None, int | None]:
    """``(image placeholder id, video placeholder id)`` from a ``config.json`` mapping or a
    Hugging Face config (each None where the config names none)."""
    def field(name: str) -> Any:
        return config.get(name) if isinstance(config, dict) else getattr(config, name, None)

    image = field("image_token_id")
    video = field("video_token_id")
    image = field("image_token_index") if image is None else image
    video = field("video_token_index") if video is None else video
    return (None if image is None else int(image)), (None if video is None else int(video))


def engine_placeholder_ids(engine: Any) -> tuple[int, ...]:
    """The placeholder ids of the checkpoint an engine serves (from its folder's ``config.json``,
    :func:`~agentloop_conformance.vision_prompts.model_folder`), else its ``image_token_id``."""
    folder = model_folder(engine)
    found = placeholder_ids(json.loads((Path(folder) / "config.json").read_text())) if folder else ()
    ids = {t for t in (*found, getattr(engine, "image_token_id", None)) if isinstance(t, int)}
    return tuple(sorted(ids))


def placeholder_preferring_checkpoint(folder: str | Path, out_dir: str | Path, *, image_margin: float = 30.0,
                                      video_margin: float = 15.0) -> Path:
    """Copy the vision-language checkpoint ``folder`` to ``out_dir`` (tokenizer, processor and
    chat template included) with weights edited so the model's next-token choice is always the
    image placeholder, then the video placeholder (see the module doc).

    Args:
        folder: A local checkpoint folder of a transformers image-text-to-text model.
        out_dir: Where to write the copy (created; an existing copy is reused).
        image_margin: About how many nats the image placeholder's logit leads ordinary tokens by.
        video_margin: The same for the video placeholder (0: leave it alone).

    Returns:
        ``out_dir``.

    Raises:
        ValueError: when ``folder``'s config names no image placeholder.
    """
    import torch
    import transformers

    folder, out = Path(folder), Path(out_dir)
    if (out / "config.json").is_file() and any(out.glob("*.safetensors")):
        return out
    image, video = placeholder_ids(json.loads((folder / "config.json").read_text()))
    if image is None:
        raise ValueError(f"{folder}/config.json names no image_token_id: not a vision-language checkpoint")
    model: Any = transformers.AutoModelForImageTextToText.from_pretrained(str(folder), dtype=torch.float32)
    embed: Any = model.get_input_embeddings().weight
    head: Any = model.get_output_embeddings().weight
    # The final norm's output in dimension 0 at a text position: about sqrt(hidden) times its
    # weight there, as the residual stream is almost all dimension 0.
    norm_weight = _final_norm_weight(model)
    scale = float(embed.shape[1]) ** 0.5 * (1.0 if norm_weight is None else float(norm_weight[0]))
    with torch.no_grad():
        embed[:, 0] = _RESIDUAL
        head[image, 0] += image_margin / scale
        if video is not None and video_margin:
            head[video, 0] += video_margin / scale
    shutil.copytree(folder, out, dirs_exist_ok=True, ignore=shutil.ignore_patterns("*.safetensors", "*.bin"))
    model.save_pretrained(str(out))
    return out


def _final_norm_weight(model: Any) -> Any:
    """The language model's final norm weight, where the usual attribute paths find it."""
    for path in ("model.language_model.norm", "model.norm", "language_model.model.norm", "language_model.norm"):
        module: Any = model
        for part in path.split("."):
            module = getattr(module, part, None)
            if module is None:
                break
        weight = getattr(module, "weight", None)
        if weight is not None:
            return weight.detach()
    return None
