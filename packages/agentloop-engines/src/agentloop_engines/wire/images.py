"""Images over the engine server's token-level ``POST /generate``: the wire format and both ends.

A prompt with images is sent as its token ids (the image placeholders already expanded by the
client's :class:`~agentloop_core.vision.VisionProcessor`) plus ``"images"``, one entry per
:class:`~agentloop_core.vision.ImageItem`, in the order of their runs of image tokens::

    {"request_id": ..., "prompt_ids": [...], "sampling_params": {...},
     "images": [{"data": "<base64 PNG>", "digest": "sha256:...", "num_tokens": 16}]}

Why this form:

* **The pixels, losslessly, once per request.** The model reads what the processor makes of
  the decoded pixels, so the pixels are what must arrive unchanged: PNG is lossless (JPEG would
  make the engine see an image other than the one the prompt was rendered for) and smaller
  than raw RGB for photos and screenshots (noise does not compress). Processed features
  (``pixel_values``, float32, Qwen-VL: 24 bytes a pixel) are not sent: about 8 times the raw
  image, and a server that ran client-made tensors through its vision
  tower would trust the client with shapes and values; the server's own processor is the
  authority, as the server is on sampling parameters.
* **The digest** (:func:`~agentloop_core.vision.image_digest`, over the decoded pixels) lets
  the server check that the pixels it decoded are exactly the ones the client rendered the
  prompt for; any change in transit or a lossy re-encoding is a 400, never a silently
  different image.
* **num_tokens** lets the server check that its processor expands the image exactly as the
  client's did (the same checkpoint's ``preprocessor_config.json``); a mismatch would otherwise
  surface as a prompt whose image tokens do not fit its images.

The server decodes each image within its :class:`~agentloop_core.vision.ImageLimits` (count
first, then bytes, then the pixels declared in the header, before any pixel is decoded: a
decompression bomb costs nothing), off the event loop, and passes the rebuilt items to the
engine as ``multi_modal_data``. Images also count towards the server's ``max_request_bytes``.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import io
import weakref
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from agentloop_core.vision import (
    ImageError,
    ImageItem,
    ImageLimits,
    VisionProcessor,
    as_rgb,
    decode_image,
    image_digest,
    multi_modal_kwargs,
)

__all__ = ["GenerateImages", "encode_images"]

_ENCODED: weakref.WeakKeyDictionary[ImageItem, dict[str, Any]] = weakref.WeakKeyDictionary()
"""Wire form of each image already sent: an agent resends a conversation's images every turn."""


def encode_images(items: Sequence[ImageItem]) -> list[dict[str, Any]]:
    """The ``"images"`` of a ``/generate`` body for ``items`` (the client side; blocking: PNG
    encoding of a large image takes tens of milliseconds, so call it off the event loop)."""
    out = []
    for item in items:
        wire = _ENCODED.get(item)
        if wire is None:
            image = as_rgb(item.image)
            buffer = io.BytesIO()
            image.save(buffer, format="PNG")
            wire = {"data": base64.b64encode(buffer.getvalue()).decode("ascii"), "digest": item.digest,
                    "num_tokens": item.num_tokens}
            _ENCODED[item] = wire
        out.append(wire)
    return out


class GenerateImages:
    """The server side: turns a ``/generate`` body's ``images`` back into ``ImageItem``\\ s.

    Args:
        server: The served ``AsyncServer`` (its ``capabilities.vision`` says whether the engine
            takes images at all).
        vision: The model's vision processor; None: images are refused with ``why_none``.
        why_none: Why there is no processor (shown in the 400).
        limits: The server's image limits.
    """

    def __init__(self, server: Any, vision: VisionProcessor | None, why_none: str, limits: ImageLimits) -> None:
        self.server = server
        self.vision = vision
        self.limits = limits
        engine = type(server).__name__
        if not getattr(getattr(server, "capabilities", None), "vision", False):
            self.refusal: str | None = (
                f"this engine reads text only: {engine} does not declare capabilities.vision, so /generate takes no "
                "images; send the prompt without images, or serve a vision-language checkpoint on an engine that "
                "takes them (hf, vllm, sglang)")
        elif vision is None:
            self.refusal = (f"this server has no vision processor to rebuild the images with ({why_none}); serve "
                            "the model from its checkpoint folder (its preprocessor_config.json), or pass "
                            "create_app(..., gateway=Gateway(server, tokenizer, vision=load_vision_processor(folder, "
                            "tokenizer)))")
        else:
            self.refusal = None
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="agentloop-images-in")

    def declared(self) -> dict[str, Any]:
        """What ``/health`` says of images: whether ``/generate`` takes them, and the limits."""
        if self.refusal is not None:
            return {"accepted": False, "reason": self.refusal}
        return {"accepted": True, "max_images": self.limits.max_images, "max_image_bytes": self.limits.max_bytes,
                "max_image_pixels": self.limits.max_pixels}

    async def multi_modal(self, images: Sequence[Any]) -> dict[str, Any]:
        """The ``generate`` keyword arguments of a body's ``images`` (objects with ``data``,
        ``digest`` and ``num_tokens``); nothing for none.

        Raises:
            ValueError: images to an engine or server that cannot take them, more than
                ``max_images``, or an image that is not valid base64, is corrupt, over a limit,
                whose pixels do not match its digest or whose token count the server's
                processor does not reproduce (an :class:`~agentloop_core.vision.ImageError`).
        """
        if not images:
            return {}
        if self.refusal is not None:
            raise ValueError(f"the request has {len(images)} image(s), but {self.refusal}")
        if len(images) > self.limits.max_images:
            raise ImageError(f"the request has {len(images)} images; this server takes at most {self.limits.max_images} "
                             "(max_images, a server setting: create_app(..., image_limits=ImageLimits(max_images=...)))")
        loop = asyncio.get_running_loop()
        items = [await loop.run_in_executor(self._pool, self._item, i, image) for i, image in enumerate(images)]
        return multi_modal_kwargs(items)

    def _item(self, index: int, wire: Any) -> ImageItem:
        where = f"images[{index}]"
        data = wire.data
        # base64 is 4/3 of the bytes: refuse before decoding what would be over the limit.
        if len(data) * 3 // 4 > self.limits.max_bytes + 3:
            raise ImageError(f"{where}: {len(data) * 3 // 4} bytes is over the limit of {self.limits.max_bytes} "
                             "(max_image_bytes); send a smaller image")
        try:
            raw = base64.b64decode(data, validate=True)
        except (binascii.Error, ValueError) as exc:
            raise ImageError(f"{where}: 'data' is not valid base64 ({exc}); send the PNG bytes base64-encoded") from None
        image = decode_image(raw, self.limits, where=where)
        digest = image_digest(image)
        if digest != wire.digest:
            raise ImageError(f"{where}: the decoded pixels have digest {digest}, not the {wire.digest!r} sent with "
                             "them: the image changed on the way (or was re-encoded lossily); send ImageItem.image as "
                             "PNG, as EngineHTTPClient does")
        if self.vision is None:  # refused before any image is decoded; kept for the type checker
            raise ValueError(self.refusal)
        item = self.vision.process(image)
        if wire.num_tokens is not None and item.num_tokens != wire.num_tokens:
            raise ImageError(f"{where}: this server's vision processor makes {item.num_tokens} image tokens of it, the "
                             f"client's made {wire.num_tokens}: client and server load different image processor "
                             "settings (preprocessor_config.json); use the server's checkpoint folder on both")
        return item
