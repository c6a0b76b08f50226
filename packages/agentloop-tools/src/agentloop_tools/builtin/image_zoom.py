"""An image zoom tool, like verl's ``image_zoom_in_tool``: the model names a box on the row's
image and reads the crop.

The image comes from the dataset row, as verl passes it:
``tools_kwargs["image_zoom_in"]["create_kwargs"]["image"]``, anything
:func:`agentloop_core.vision.decode_image` accepts (a PIL image, encoded bytes, a
``{"bytes": ...}`` cell of a parquet ``images`` column, a data URL or a local path). It is
decoded once, at ``create``. The model calls ``image_zoom_in`` with ``bbox_2d: [x1, y1, x2, y2]``
in pixels of that image (top-left inclusive, bottom-right exclusive) and an optional ``label``;
the crop comes back as an image, enlarged so its short side is at least
:data:`MIN_SIDE` pixels (Qwen-VL reads an image in 28 x 28 patches and refuses a smaller one).
A box the tool cannot crop is error text for the model that says what is wrong and the image's
size, with ``success: 0`` in the call's metrics.
"""

from __future__ import annotations

import math
from typing import Any

from agentloop_core.vision import ImageError, ImageLimits, decode_image
from agentloop_core.vision.images import require_pillow
from agentloop_tools.base import BaseTool
from agentloop_tools.schema import OpenAIFunctionToolSchema, ToolResponse

__all__ = ["MAX_ASPECT_RATIO", "MIN_SIDE", "ImageZoomInTool", "crop_box"]

MIN_SIDE = 28
"""Shortest side of a returned crop, in pixels: Qwen-VL's patch (14) times its merge size (2)."""
MAX_ASPECT_RATIO = 100
"""Longest side over shortest side of a box the tool crops (Qwen-VL refuses images above 200)."""


def crop_box(bbox: Any, size: tuple[int, int]) -> tuple[int, int, int, int]:
    """The pixel box ``(x1, y1, x2, y2)`` of a model's ``bbox_2d`` on an image of ``size``.

    Coordinates may be floats; they are rounded to the nearest pixel.

    Raises:
        ValueError: not four numbers, outside the image, empty (x2 <= x1 or y2 <= y1), or more
            elongated than :data:`MAX_ASPECT_RATIO`; the message says which and the image's size.
    """
    width, height = size
    if not isinstance(bbox, (list, tuple)) or len(bbox) != 4:
        got = f"{len(bbox)} values" if isinstance(bbox, (list, tuple)) else type(bbox).__name__
        raise ValueError(f"bbox_2d must be 4 numbers [x1, y1, x2, y2], got {got}")
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in bbox):
        raise ValueError(f"bbox_2d must be 4 numbers [x1, y1, x2, y2], got {list(bbox)!r}")
    x1, y1, x2, y2 = (round(v) for v in bbox)
    if x2 <= x1 or y2 <= y1:
        raise ValueError(f"bbox_2d {list(bbox)} is empty: it needs x2 > x1 and y2 > y1")
    if x1 < 0 or y1 < 0 or x2 > width or y2 > height:
        raise ValueError(f"bbox_2d {list(bbox)} is outside the image, which is {width}x{height} pixels "
                         f"(x in 0..{width}, y in 0..{height})")
    w, h = x2 - x1, y2 - y1
    if max(w, h) > MAX_ASPECT_RATIO * min(w, h):
        raise ValueError(f"bbox_2d {list(bbox)} is {w}x{h} pixels, more elongated than {MAX_ASPECT_RATIO}:1; "
                         "choose a squarer region")
    return x1, y1, x2, y2


class ImageZoomInTool(BaseTool):
    """Crops the row's image to a box and returns the crop as an image.

    Config keys: ``timeout_s`` (see BaseTool); ``max_pixels`` and ``max_bytes``, the limits on
    the row's image (defaults: :class:`~agentloop_core.vision.ImageLimits`'). The default
    schema names the tool ``image_zoom_in`` with ``bbox_2d`` (required) and ``label``.

    Raises:
        ValueError: a config limit that is not a positive integer.
    """

    def __init__(self, config: dict[str, Any] | None = None, tool_schema: Any = None) -> None:
        super().__init__(config, tool_schema)
        defaults = ImageLimits()
        limits = {key: self.config.get(key, getattr(defaults, key)) for key in ("max_pixels", "max_bytes")}
        for key, value in limits.items():
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"tool {self.name!r}: config {key} must be a positive integer, got {value!r}")
        self.limits = ImageLimits(**limits, max_images=1)

    def default_tool_schema(self) -> OpenAIFunctionToolSchema:
        return OpenAIFunctionToolSchema.model_validate({
            "type": "function",
            "function": {
                "name": "image_zoom_in",
                "description": "Zoom in on a region of the image by cropping it to a bounding box, "
                               "optionally naming the object in it.",
                "parameters": {
                    "type": "object",
                    "properties": {
                        "bbox_2d": {
                            "type": "array", "items": {"type": "number"}, "minItems": 4, "maxItems": 4,
                            "description": "The region as [x1, y1, x2, y2] in pixels of the original image: "
                                           "(x1, y1) its top-left corner, (x2, y2) its bottom-right corner.",
                        },
                        "label": {"type": "string", "description": "The object in the region (optional)."},
                    },
                    "required": ["bbox_2d"],
                },
            },
        })

    async def init_state(self, image: Any = None, **extra: Any) -> dict[str, Any]:
        """Args:
            image: The row's image (anything ``decode_image`` accepts).

        Raises:
            ValueError: no image, extra keys, or an image ``decode_image`` refuses; the message
                names the row key.
        """
        key = f"tools_kwargs[{self.name!r}]['create_kwargs']"
        if extra:
            raise ValueError(f"tool {self.name!r}: unexpected create kwargs {sorted(extra)} in {key}; only 'image'")
        if image is None:
            raise ValueError(f"tool {self.name!r} needs the row's image: set {key}['image'] (a PIL image, bytes, "
                             "a {'bytes': ...} cell, a data URL or a path)")
        if isinstance(image, (list, tuple)):
            raise ValueError(f"tool {self.name!r}: {key}['image'] is a list of {len(image)}; pass the one image "
                             "to zoom in on (e.g. images[0])")
        try:
            decoded = decode_image(image, self.limits, where=f"{key}['image']")
        except ImageError as exc:
            raise ValueError(f"tool {self.name!r}: {exc}") from None
        return {"image": decoded, "calls": 0}

    # No **kwargs, as BaseTool.execute allows: a row that gives execute_kwargs is an error.
    async def execute(  # pyright: ignore[reportIncompatibleMethodOverride]
        self, instance_id: str, parameters: dict[str, Any]
    ) -> tuple[ToolResponse, float, dict[str, Any]]:
        state = self.state(instance_id)
        state["calls"] += 1
        image = state["image"]
        try:
            box = crop_box(parameters.get("bbox_2d"), image.size)
        except ValueError as exc:
            return ToolResponse(text=f"Error: {exc}."), 0.0, {"success": 0}
        crop = image.crop(box)
        if min(crop.size) < MIN_SIDE:
            scale = MIN_SIDE / min(crop.size)
            size = (max(MIN_SIDE, math.ceil(crop.width * scale)), max(MIN_SIDE, math.ceil(crop.height * scale)))
            crop = crop.resize(size, require_pillow().Resampling.BICUBIC)
        label = parameters.get("label")
        what = f" ({label})" if isinstance(label, str) and label else ""
        x1, y1, x2, y2 = box
        text = (f"Zoomed in on [{x1}, {y1}, {x2}, {y2}]{what}: {x2 - x1}x{y2 - y1} pixels, "
                f"shown at {crop.width}x{crop.height}.")
        return ToolResponse(text=text, image=[crop]), 0.0, {"success": 1}
