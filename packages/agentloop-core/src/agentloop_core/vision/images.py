"""Images as they enter a trajectory: decoded once, checked against limits, never trusted.

Every image a loop sees (a dataset row's ``images`` column, an OpenAI content part, a tool's
:class:`ToolResponse`, an environment observation, a gateway request) goes through
:func:`decode_image` exactly once per sample. The pixel limit is checked on the header
(``Image.open`` reads only the header) before any pixel is decoded, so a small file that
declares a huge canvas (a decompression bomb) costs nothing; the byte limit is checked before
the header is read. Every refusal is an :class:`ImageError` naming the limit, the value seen
and the key that raises it.
"""

from __future__ import annotations

import base64
import binascii
import io
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["ImageError", "ImageLimitError", "ImageLimits", "as_rgb", "decode_image", "require_pillow"]


class ImageError(ValueError):
    """An image that cannot enter a trajectory: corrupt, too large, from a refused source."""


class ImageLimitError(ImageError):
    """An image a setting refuses (:class:`ImageLimits`: over ``max_image_bytes``,
    ``max_image_pixels`` or ``max_images``, a file path or remote URL not allowed): under other
    settings it may enter, unlike an unreadable one."""


@dataclass(frozen=True)
class ImageLimits:
    """Where images are refused. The rollout's tool loops read the limits from their config
    (``multi_turn.max_image_pixels``, ``max_image_bytes``, ``max_images``) and the gateway from
    options of the same names; messages name those keys."""

    max_pixels: int = 16_777_216
    """Most pixels (width x height) an image may declare; checked on the header, before decoding
    (4096 x 4096 by default: a phone photo passes, a decompression bomb does not)."""
    max_bytes: int = 20 * 2**20
    """Most encoded bytes of one image (20 MiB)."""
    max_images: int = 32
    """Most images in one trajectory, prompt and tool results together."""
    allow_paths: bool = True
    """Whether a local file path (or ``file://`` URL) is a source. True for dataset rows, which
    the user wrote; False for what a client or a tool sends."""
    allow_remote_urls: bool = False
    """Whether ``http(s)://`` URLs are fetched. Off: a rollout that fetches what a policy names
    is a way out of the sandbox, and the machines that train rarely reach the internet."""

    def __post_init__(self) -> None:
        for field, key in (("max_pixels", "max_image_pixels"), ("max_bytes", "max_image_bytes"),
                           ("max_images", "max_images")):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{key} must be a positive integer, got {value!r}")


def require_pillow() -> Any:
    """The ``PIL.Image`` module, or ImportError naming the install line."""
    try:
        from PIL import Image
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError('images need Pillow: pip install "agentloop-core[vision]"') from exc
    return Image


def decode_image(source: Any, limits: ImageLimits | None = None, *, where: str = "image") -> Any:
    """One image as an RGB ``PIL.Image.Image``, within ``limits``.

    Args:
        source: A PIL image; encoded ``bytes``; a ``data:image/...;base64,`` URL; a local path
            or ``file://`` URL (when ``limits.allow_paths``); a mapping with ``bytes`` and/or
            ``path`` (a Hugging Face ``datasets.Image`` cell, as verl's parquet rows hold them),
            ``url`` or ``image_url``.
        limits: The limits; None: the defaults.
        where: What the image is, for errors (``"row 3: images[1]"``, ``"tool 'zoom' result"``).

    Returns:
        The decoded image, converted to RGB (palette, alpha and greyscale images included).

    Raises:
        ImageError: the source is of no known form, a refused URL, corrupt, or over a limit.
    """
    limits = limits or ImageLimits()
    Image = require_pillow()
    if isinstance(source, Image.Image):
        image = source
        _check_pixels(image.size, limits, where)
    else:
        data = _encoded_bytes(source, limits, where)
        if len(data) > limits.max_bytes:
            raise ImageLimitError(f"{where}: {len(data)} bytes is over the limit of {limits.max_bytes} "
                             "(max_image_bytes); send a smaller or more compressed image")
        try:
            image = Image.open(io.BytesIO(data))  # reads the header only
        except Image.DecompressionBombError as exc:
            # Pillow's own guard (twice its MAX_IMAGE_PIXELS) fires on the header too.
            raise ImageLimitError(f"{where}: the image declares more pixels than the limit of {limits.max_pixels} "
                             f"(max_image_pixels): {exc}") from None
        except Exception as exc:  # noqa: BLE001 - every decoder error means the same to the caller
            raise ImageError(f"{where}: not a readable image ({type(exc).__name__}: {exc})") from None
        _check_pixels(image.size, limits, where)
        try:
            image.load()
        except Exception as exc:  # noqa: BLE001 - truncated or corrupt pixel data
            raise ImageError(f"{where}: the image data is corrupt ({type(exc).__name__}: {exc})") from None
    if getattr(image, "n_frames", 1) > 1:
        image.seek(0)  # an animated image: its first frame (videos are refused elsewhere)
    return as_rgb(image)


def as_rgb(image: Any) -> Any:
    """``image`` in RGB. Transparent pixels are laid on white, as transformers' ``convert_to_rgb``
    (the vision processors' ``do_convert_rgb``) and verl's ``qwen_vl_utils`` do: a plain
    ``convert("RGB")`` drops alpha, so black line art on a transparent background (a chart saved
    with ``transparent=True``, an icon) would reach the model as an all-black image."""
    if image.mode == "RGB":
        return image
    if image.mode in ("RGBA", "RGBa", "LA", "La", "PA") or "transparency" in image.info:
        from PIL import Image

        rgba = image.convert("RGBA")
        return Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba).convert("RGB")
    return image.convert("RGB")


def _check_pixels(size: tuple[int, int], limits: ImageLimits, where: str) -> None:
    width, height = size
    if width < 1 or height < 1:
        raise ImageError(f"{where}: an image of {width}x{height} pixels has no pixels")
    if width * height > limits.max_pixels:
        raise ImageLimitError(f"{where}: {width}x{height} = {width * height} pixels is over the limit of "
                         f"{limits.max_pixels} (max_image_pixels); resize it first")


def _encoded_bytes(source: Any, limits: ImageLimits, where: str) -> bytes:
    if isinstance(source, (bytes, bytearray, memoryview)):
        return bytes(source)
    if isinstance(source, Mapping):
        if source.get("bytes") is not None:
            return _encoded_bytes(source["bytes"], limits, where)
        for key in ("path", "url", "image_url", "image"):
            if source.get(key) is not None:
                value = source[key]
                return _encoded_bytes(value.get("url") if isinstance(value, Mapping) else value, limits, where)
        raise ImageError(f"{where}: a mapping without 'bytes', 'path' or 'url' (keys: {sorted(map(str, source))})")
    if isinstance(source, os.PathLike):
        source = os.fspath(source)
    if isinstance(source, str):
        return _from_string(source, limits, where)
    raise ImageError(f"{where}: an image must be a PIL image, bytes, a data URL, a path or a mapping with "
                     f"'bytes'/'path', got {type(source).__name__}")


def _from_string(text: str, limits: ImageLimits, where: str) -> bytes:
    if text.startswith("data:"):
        header, comma, payload = text.partition(",")
        if not comma or ";base64" not in header:
            raise ImageError(f"{where}: a data URL must be 'data:image/<type>;base64,<data>'")
        if not header[5:].startswith("image/"):
            raise ImageError(f"{where}: a data URL of type {header[5:].split(';')[0]!r}; only image/* is an image")
        # base64 is 4/3 of the bytes: refuse before decoding what would be over the limit.
        if len(payload) * 3 // 4 > limits.max_bytes + 3:
            raise ImageLimitError(f"{where}: {len(payload) * 3 // 4} bytes is over the limit of {limits.max_bytes} "
                             "(max_image_bytes); send a smaller or more compressed image")
        try:
            return base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError) as exc:
            raise ImageError(f"{where}: the data URL's base64 is invalid ({exc})") from None
    lowered = text[:8].lower()
    if lowered.startswith(("http://", "https://")):
        if not limits.allow_remote_urls:
            raise ImageLimitError(f"{where}: remote image URLs are refused ({text[:60]!r}); send the image as a data "
                             "URL or bytes, or allow remote image URLs where the machine may fetch them")
        return _fetch(text, limits, where)
    if not limits.allow_paths:
        raise ImageLimitError(f"{where}: a file path is not accepted here; send the image as a data URL or bytes")
    path = Path(text[7:] if text.startswith("file://") else text).expanduser()
    try:
        size = path.stat().st_size
    except OSError as exc:
        raise ImageError(f"{where}: cannot read image file {str(path)!r} ({exc.strerror or exc})") from None
    if size > limits.max_bytes:
        raise ImageLimitError(f"{where}: {str(path)!r} has {size} bytes, over the limit of {limits.max_bytes} "
                         "(max_image_bytes)")
    return path.read_bytes()


def _fetch(url: str, limits: ImageLimits, where: str) -> bytes:
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=10) as response:  # noqa: S310 - http(s) only, checked above
            data = response.read(limits.max_bytes + 1)
    except OSError as exc:
        raise ImageError(f"{where}: fetching {url[:80]!r} failed ({exc})") from None
    if len(data) > limits.max_bytes:
        raise ImageLimitError(f"{where}: {url[:80]!r} is over the limit of {limits.max_bytes} bytes (max_image_bytes)")
    return data
