"""The Idefics3 vision family (SmolVLM's architecture in transformers, ``model_type``
``idefics3``).

Its chat template writes ``<image>`` once per image part. The image processor resizes the
image, cuts it into ``rows x cols`` square tiles and adds the whole image downscaled (the
global view); each tile becomes ``image_seq_len`` image tokens. The placeholder expands to
structured text, as transformers' ``Idefics3Processor`` writes it::

    <fake_token_around_image><row_1_col_1><image>...<image><fake_token_around_image><row_1_col_2>...\\n
    ...
    \\n<fake_token_around_image><global-img><image>...<image><fake_token_around_image>

so one image fills several runs of image tokens (a :class:`TiledImageItem`, whose
``run_lengths`` :func:`~agentloop_core.vision.processor.image_token_runs` checks). Positions are
plain 1-D; the model takes ``pixel_values`` ``[1, tiles, 3, H, W]`` and
``pixel_attention_mask`` ``[1, tiles, H, W]`` (:func:`~agentloop_core.vision.processor.stack_features`).
The image processor is transformers' ``Idefics3ImageProcessorPil`` (no torchvision).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from agentloop_core.vision.processor import (
    TiledImageItem,
    VisionProcessor,
    image_digest,
    register_vision_family,
)

__all__ = ["FAKE_TOKEN", "GLOBAL_TOKEN", "IMAGE_TOKEN", "Idefics3Processor", "idefics3_special_tokens"]

IMAGE_TOKEN = "<image>"
FAKE_TOKEN = "<fake_token_around_image>"
GLOBAL_TOKEN = "<global-img>"
MAX_TILES_PER_SIDE = 6
"""Idefics3 tokenizers carry ``<row_i_col_j>`` for i, j in 1..6."""


def idefics3_special_tokens() -> list[str]:
    """The special tokens an Idefics3 tokenizer needs besides its text ones."""
    tiles = [f"<row_{i}_col_{j}>" for i in range(1, MAX_TILES_PER_SIDE + 1) for j in range(1, MAX_TILES_PER_SIDE + 1)]
    return [FAKE_TOKEN, IMAGE_TOKEN, GLOBAL_TOKEN, *tiles]


class Idefics3Processor(VisionProcessor):
    """Idefics3 / SmolVLM: tiles plus a global view, ``image_seq_len`` ``<image>`` tokens each,
    between ``<fake_token_around_image>`` and ``<row_i_col_j>`` / ``<global-img>`` markers.

    Args:
        image_processor: ``Idefics3ImageProcessorPil`` (or one called the same way:
            ``image_processor(images=[[image]], return_row_col_info=True, return_tensors="np")``).
        tokenizer: The model's tokenizer; it must know the family's special tokens.
        image_seq_len: Image tokens per tile: ``(image_size // patch_size) ** 2 // scale_factor ** 2``.
    """

    image_token = IMAGE_TOKEN

    def __init__(self, image_processor: Any, tokenizer: Any, *, image_seq_len: int,
                 model_type: str = "idefics3") -> None:
        unk = getattr(tokenizer, "unk_token_id", None)
        missing = [t for t in idefics3_special_tokens()
                   if not isinstance(tokenizer.convert_tokens_to_ids(t), int) or tokenizer.convert_tokens_to_ids(t) == unk]
        if missing:
            raise ValueError(f"the tokenizer lacks the Idefics3 special token(s) {missing[:4]}"
                             f"{' ...' if len(missing) > 4 else ''}; an Idefics3/SmolVLM tokenizer has "
                             "<fake_token_around_image>, <image>, <global-img> and <row_i_col_j> for i, j in 1..6")
        if image_seq_len < 1:
            raise ValueError(f"image_seq_len must be >= 1, got {image_seq_len}")
        self.image_processor = image_processor
        self.image_token_id = int(tokenizer.convert_tokens_to_ids(IMAGE_TOKEN))
        self.image_seq_len = int(image_seq_len)
        self.model_type = model_type

    def process(self, image: Any) -> TiledImageItem:
        out = self.image_processor(images=[[image]], return_row_col_info=True, return_tensors="np")
        rows, cols = int(out["rows"][0][0]), int(out["cols"][0][0])
        if rows > MAX_TILES_PER_SIDE or cols > MAX_TILES_PER_SIDE:
            raise ValueError(f"the image processor cut the image into {rows} x {cols} tiles; Idefics3 names at most "
                             f"{MAX_TILES_PER_SIDE} x {MAX_TILES_PER_SIDE} (lower its size['longest_edge'])")
        features = {"pixel_values": out["pixel_values"][0], "pixel_attention_mask": out["pixel_attention_mask"][0]}
        return TiledImageItem(image=image, digest=image_digest(image), features=features, rows=rows, cols=cols,
                              num_tokens=self.image_seq_len * (rows * cols + 1), tokens_per_tile=self.image_seq_len)

    def expansion(self, item: Any) -> str:
        run = IMAGE_TOKEN * self.image_seq_len
        text = ""
        for i in range(item.rows):
            text += "".join(f"{FAKE_TOKEN}<row_{i + 1}_col_{j + 1}>{run}" for j in range(item.cols)) + "\n"
        return text + ("\n" if item.rows else "") + f"{FAKE_TOKEN}{GLOBAL_TOKEN}{run}{FAKE_TOKEN}"


@register_vision_family("idefics3")
def load_idefics3(folder: Path, tokenizer: Any) -> Idefics3Processor:
    """The processor of an Idefics3 checkpoint folder: ``preprocessor_config.json`` for the
    image processor, ``config.json`` for the image tokens per tile."""
    try:
        from transformers import Idefics3ImageProcessorPil
    except ImportError as exc:  # pragma: no cover - depends on the transformers release
        raise ImportError("the Idefics3 image processor needs transformers >= 5.0 (Idefics3ImageProcessorPil)") from exc
    folder = Path(folder)
    settings_file = folder / "preprocessor_config.json"
    if not settings_file.is_file():
        raise FileNotFoundError(f"{folder} has no preprocessor_config.json; a vision checkpoint folder carries its "
                                "image processor's settings there")
    settings = json.loads(settings_file.read_text())
    kept = {k: v for k, v in settings.items() if k in _IMAGE_KEYS}
    config = json.loads((folder / "config.json").read_text())
    vision = config.get("vision_config", {})
    patches = (int(vision.get("image_size", 224)) // int(vision.get("patch_size", 32))) ** 2
    image_seq_len = patches // int(config.get("scale_factor", 2)) ** 2
    return Idefics3Processor(Idefics3ImageProcessorPil(**kept), tokenizer, image_seq_len=image_seq_len)


_IMAGE_KEYS = {"do_resize", "size", "max_image_size", "do_image_splitting", "do_pad", "image_mean", "image_std",
               "do_rescale", "rescale_factor", "do_normalize", "do_convert_rgb", "resample"}
