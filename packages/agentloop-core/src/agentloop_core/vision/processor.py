"""What a vision-language model's processor does to an image, as the renderer needs it.

A chat template writes one placeholder per image part (``<|image_pad|>`` for the Qwen-VL
family); the model reads as many image tokens there as its vision tower makes of the image
(``grid_t * grid_h * grid_w / merge_size**2`` for Qwen-VL). A :class:`VisionProcessor` turns a
decoded image into an :class:`ImageItem` (its model inputs and that token count, computed once)
and expands each placeholder of a rendered text into the item's tokens, so every image token
is rendered text like any other mask-0 token and the delta method and its sanity check hold
with images exactly as without.

Families are plug-ins keyed by the checkpoint's ``model_type``: :func:`register_vision_family`
or the ``agentloop.vision_families`` entry-point group (a factory ``(folder, tokenizer) ->
VisionProcessor``). :func:`load_vision_processor` finds the family of any checkpoint folder.
"""

from __future__ import annotations

import abc
import hashlib
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agentloop_core.plugins import PluginRegistry
from agentloop_core.vision.images import ImageError

__all__ = [
    "ENTRY_POINT_GROUP",
    "ImageItem",
    "QwenVLProcessor",
    "TiledImageItem",
    "VisionProcessor",
    "image_token_runs",
    "load_vision_processor",
    "register_vision_family",
    "stack_features",
    "vision_families",
]

ENTRY_POINT_GROUP = "agentloop.vision_families"


@dataclass(frozen=True, eq=False)
class ImageItem:
    """One image of a trajectory, decoded and processed once."""

    image: Any
    """The decoded RGB ``PIL.Image.Image`` (as it entered; engines that process images
    themselves, vLLM and SGLang, are given this)."""
    digest: str
    """``sha256:`` + 32 hex digits of the decoded pixels (mode, size, bytes): the image's name
    in a conversation's messages (``{"type": "image", "image": digest}``)."""
    num_tokens: int
    """How many image tokens the model reads for it (the placeholder's expansion)."""
    features: Mapping[str, Any] = field(default_factory=dict)
    """The model inputs of this image alone, as numpy arrays (Qwen-VL: ``pixel_values``
    ``[patches, channels * temporal * patch**2]`` and ``image_grid_thw`` ``[1, 3]``)."""

    @property
    def run_lengths(self) -> tuple[int, ...]:
        """The lengths of the runs of image tokens the image fills, in order: one run of
        :attr:`num_tokens` here; a tiled image (:class:`TiledImageItem`) fills one per tile."""
        return (self.num_tokens,)

    def __repr__(self) -> str:
        size = getattr(self.image, "size", "?")
        return f"{type(self).__name__}({self.digest[:19]}, size={size}, num_tokens={self.num_tokens})"


@dataclass(frozen=True, eq=False, repr=False)
class TiledImageItem(ImageItem):
    """An image a family cuts into tiles, each read as its own run of image tokens between
    text that names the tile (Idefics3/SmolVLM: ``rows x cols`` tiles, then the whole image
    downscaled). Its features hold one entry per tile along the first axis, and a model takes
    the tiles of every image of a batch as one row of images (:func:`stack_features`)."""

    rows: int = 0
    """Tile rows (0 with ``cols`` 0: the image was not split, only its global view is read)."""
    cols: int = 0
    """Tile columns."""
    tokens_per_tile: int = 0
    """Image tokens of one tile (and of the global view)."""

    @property
    def run_lengths(self) -> tuple[int, ...]:
        return (self.tokens_per_tile,) * (self.rows * self.cols + 1)


def stack_features(items: Sequence[ImageItem]) -> dict[str, Any]:
    """The model inputs of several images in order, as numpy arrays concatenated on the first
    axis; empty for none.

    Tiled images (:class:`TiledImageItem`) may differ in their trailing axes: those are
    zero-padded to the largest (the pixel mask marks the padding), and every input gets a
    leading batch axis of one: a tiled model (Idefics3) flattens batch and tile axes anyway and
    fills its image tokens in order, so the tiles of all rows go in as one row. Untiled images
    must agree in their trailing axes (a feature of another shape is an error, not padded).
    """
    import numpy as np

    if not items:
        return {}
    tiled = all(isinstance(item, TiledImageItem) for item in items)
    out: dict[str, Any] = {}
    for key in items[0].features:
        arrays = [np.asarray(item.features[key]) for item in items]
        if not tiled:
            out[key] = np.concatenate(arrays, axis=0)
            continue
        shape = [max(a.shape[d] for a in arrays) for d in range(1, arrays[0].ndim)]
        padded = [np.pad(a, [(0, 0)] + [(0, n - m) for n, m in zip(shape, a.shape[1:], strict=True)]) for a in arrays]
        out[key] = np.concatenate(padded, axis=0)[None]
    return out


def image_token_runs(prompt_ids: Sequence[int], images: Sequence[ImageItem], token_id: int) -> list[tuple[int, int]]:
    """Where each image's tokens lie in ``prompt_ids``: one ``(start, end)`` per image, in
    order. An image fills runs of ``token_id`` exactly as long as its :attr:`ImageItem.run_lengths`
    (one run of ``num_tokens`` for Qwen-VL; one per tile for a tiled image, whose span then
    runs from its first run's start to its last run's end, the tiles' text between them).

    Raises:
        ValueError: when the prompt's image tokens are not the images' expansions (a prompt
            rendered for other images or in another order, or image tokens typed as text).
    """
    runs: list[tuple[int, int]] = []
    start = None
    for i, tok in enumerate([*prompt_ids, None]):
        if tok == token_id and start is None:
            start = i
        elif tok != token_id and start is not None:
            runs.append((start, i))
            start = None
    found = [end - begin for begin, end in runs]
    expected = [n for item in images for n in item.run_lengths]
    if found != expected:
        raise ValueError(
            f"the prompt holds {sum(found)} image tokens (id {token_id}) in {len(found)} run(s) of {found} but its "
            f"{len(images)} image(s) fill {expected}; render the prompt with the model's vision processor and send "
            "its images in order (multi_modal_data={'image': trajectory.image_items})")
    spans: list[tuple[int, int]] = []
    k = 0
    for item in images:
        n = len(item.run_lengths)
        spans.append((runs[k][0], runs[k + n - 1][1]))
        k += n
    return spans


def image_digest(image: Any) -> str:
    """The :attr:`ImageItem.digest` of a decoded image."""
    h = hashlib.sha256(f"{image.mode}:{image.size[0]}x{image.size[1]}:".encode())
    h.update(image.tobytes())
    return "sha256:" + h.hexdigest()[:32]


class VisionProcessor(abc.ABC):
    """A model family's image processing, as rendering, engines and the trainer use it.

    Attributes:
        image_token: The placeholder text the chat template writes for one image part.
        image_token_id: Its token id; the expanded image tokens all carry it.
        mrope: Whether the model places image tokens with 3-D (M-RoPE) positions, which the
            engine and the trainer then compute from ``image_grid_thw``.
        model_type: The checkpoint's ``model_type`` this processor was built for.
    """

    image_token: str
    image_token_id: int
    mrope: bool = False
    model_type: str = ""

    @abc.abstractmethod
    def process(self, image: Any) -> ImageItem:
        """The :class:`ImageItem` of one decoded RGB image (resized as the model wants it)."""

    def expansion(self, item: ImageItem) -> str:
        """The text that replaces one placeholder: ``image_token`` once per image token."""
        return self.image_token * item.num_tokens

    def expand(self, text: str, items: Sequence[ImageItem], *, where: str = "rendered text") -> str:
        """``text`` with its k-th placeholder replaced by the expansion of ``items[k]``.

        Raises:
            ImageError: when the text holds a different number of placeholders than there are
                images (a template that drops image parts, or the placeholder's text inside a
                text part, where it would otherwise become image tokens no image fills).
        """
        parts = text.split(self.image_token)
        if len(parts) - 1 != len(items):
            raise ImageError(
                f"{where} has {len(parts) - 1} image placeholder(s) {self.image_token!r} but {len(items)} image(s) "
                "go with it: the chat template must render each image part once (and a text part may not "
                "contain the placeholder's text)")
        if not items:
            return text
        out = [parts[0]]
        for item, rest in zip(items, parts[1:], strict=True):
            out.append(self.expansion(item))
            out.append(rest)
        return "".join(out)

    def model_inputs(self, items: Sequence[ImageItem]) -> dict[str, Any]:
        """The model inputs of several images in order (:func:`stack_features`); empty for none."""
        return stack_features(items)


class QwenVLProcessor(VisionProcessor):
    """Qwen2-VL, Qwen2.5-VL and Qwen3-VL: ``<|image_pad|>`` tokens between
    ``<|vision_start|>``/``<|vision_end|>``, one per ``merge_size**2`` patches, 3-D positions.

    Args:
        image_processor: A Qwen-VL image processor (``Qwen2VLImageProcessorPil`` works without
            torchvision); called as ``image_processor(images=[image], return_tensors="np")``.
        tokenizer: The model's tokenizer (for the placeholder's id).
        image_token: The placeholder, ``<|image_pad|>`` unless the tokenizer names another.
    """

    mrope = True

    def __init__(self, image_processor: Any, tokenizer: Any, *, image_token: str | None = None,
                 model_type: str = "qwen2_vl") -> None:
        self.image_processor = image_processor
        self.image_token = image_token or getattr(tokenizer, "image_token", None) or "<|image_pad|>"
        token_id = tokenizer.convert_tokens_to_ids(self.image_token)
        if not isinstance(token_id, int) or token_id == getattr(tokenizer, "unk_token_id", None) or token_id < 0:
            raise ValueError(f"the tokenizer has no token {self.image_token!r}; a Qwen-VL tokenizer needs its vision "
                             "special tokens (<|vision_start|>, <|image_pad|>, <|vision_end|>)")
        self.image_token_id = int(token_id)
        self.merge_size = int(getattr(image_processor, "merge_size", 2))
        self.model_type = model_type

    def process(self, image: Any) -> ImageItem:
        out = self.image_processor(images=[image], return_tensors="np")
        grid = out["image_grid_thw"]
        n = int(grid[0][0]) * int(grid[0][1]) * int(grid[0][2]) // (self.merge_size ** 2)
        return ImageItem(image=image, digest=image_digest(image), num_tokens=n,
                         features={"pixel_values": out["pixel_values"], "image_grid_thw": grid})


def _qwen_vl(folder: Path, tokenizer: Any, model_type: str) -> VisionProcessor:
    try:
        from transformers import Qwen2VLImageProcessorPil
    except ImportError as exc:  # pragma: no cover - depends on the transformers release
        raise ImportError("the Qwen-VL image processor needs transformers >= 5.0 (Qwen2VLImageProcessorPil)") from exc
    config_file = folder / "preprocessor_config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"{folder} has no preprocessor_config.json; a vision checkpoint folder carries its "
                                "image processor's settings there")
    settings = json.loads(config_file.read_text())
    kept = {k: v for k, v in settings.items() if k in _QWEN_IMAGE_KEYS}
    return QwenVLProcessor(Qwen2VLImageProcessorPil(**kept), tokenizer, model_type=model_type)


_QWEN_IMAGE_KEYS = {"do_resize", "size", "min_pixels", "max_pixels", "patch_size", "temporal_patch_size", "merge_size",
                    "image_mean", "image_std", "do_rescale", "rescale_factor", "do_normalize", "do_convert_rgb"}

VisionFactory = Callable[[Path, Any], VisionProcessor]
_REGISTRY: PluginRegistry[VisionFactory] = PluginRegistry(
    "vision family", ENTRY_POINT_GROUP, describe=repr,
    how_to_add=lambda t: (f"Add one with @agentloop_core.vision.register_vision_family({t!r}) or an entry point in "
                          f"the {ENTRY_POINT_GROUP!r} group"))


def register_vision_family(*model_types: str) -> Callable[[VisionFactory], VisionFactory]:
    """Register a factory ``(folder, tokenizer) -> VisionProcessor`` for checkpoints whose
    ``config.json`` declares one of ``model_types``.

    Raises:
        ValueError: another factory already holds one of ``model_types``.
    """

    def decorator(factory: VisionFactory) -> VisionFactory:
        for model_type in model_types:
            _REGISTRY.add(model_type, factory)
        return factory

    return decorator


for _model_type in ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe"):
    register_vision_family(_model_type)(lambda folder, tokenizer, _t=_model_type: _qwen_vl(folder, tokenizer, _t))


def vision_families() -> list[str]:
    """The ``model_type`` values with a registered vision family (entry points included)."""
    return _REGISTRY.names()


def model_type_of(folder: str | Path) -> str | None:
    """``model_type`` from a checkpoint folder's ``config.json`` (None without one)."""
    config = Path(folder) / "config.json"
    if not config.is_file():
        return None
    try:
        return json.loads(config.read_text()).get("model_type")
    except (OSError, ValueError):
        return None


def load_vision_processor(folder: str | Path, tokenizer: Any) -> VisionProcessor | None:
    """The vision processor of the checkpoint in ``folder``; None for a text-only model.

    A folder whose ``config.json`` has a ``vision_config`` but no registered family is an
    error naming the families there are and how to add one, never a silent text-only model.
    """
    folder = Path(folder)
    model_type = model_type_of(folder)
    if model_type is None:
        return None
    if model_type not in _REGISTRY.entries:
        _REGISTRY.load_entry_points()
    factory = _REGISTRY.entries.get(model_type)
    if factory is None:
        config = json.loads((folder / "config.json").read_text())
        if "vision_config" not in config:
            return None
        broken = f" ({_REGISTRY.broken[model_type]})" if model_type in _REGISTRY.broken else ""
        raise ValueError(
            f"{folder} is a vision model of type {model_type!r}{broken}, and no vision family handles it; known: "
            f"{', '.join(vision_families())}. Add one with @agentloop_core.vision.register_vision_family("
            f"{model_type!r}) or an entry point in the {ENTRY_POINT_GROUP!r} group")
    return factory(folder, tokenizer)
