"""Image parts of chat messages: what forms they arrive in, and the one form a trajectory keeps.

Messages arrive with images in any of the forms users write: OpenAI content parts
(``{"type": "image_url", "image_url": {"url": "data:..."}}``), Hugging Face / Qwen parts
(``{"type": "image", "image": <PIL image, bytes, path>}``), Responses-API parts
(``{"type": "input_image", "image_url": ...}``) or verl's rows (``<image>`` markers in the text
and an ``images`` column, see :func:`messages_with_row_images`). :class:`ConversationImages`
decodes and processes each image once, when it enters, and leaves in the messages a part
``{"type": "image", "image": "sha256:..."}`` that every chat template renders as an image and
that is plain JSON (so renders can be cached and the sanity check can tell the messages are
unchanged). The images travel beside the messages, in order.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from agentloop_core.vision.images import ImageError, ImageLimitError, ImageLimits, decode_image
from agentloop_core.vision.processor import ImageItem, VisionProcessor

__all__ = [
    "IMAGE_MARKER",
    "IMAGE_PART_TYPES",
    "VIDEO_PART_TYPES",
    "ConversationImages",
    "has_images",
    "image_refs",
    "image_source",
    "images_of",
    "messages_with_row_images",
    "multi_modal_kwargs",
]

IMAGE_MARKER = "<image>"
"""Where verl's preprocessing puts an image in a prompt's text (geo3k and the other VL recipes)."""
VIDEO_MARKER = "<video>"

IMAGE_PART_TYPES = frozenset({"image", "image_url", "input_image"})
"""Content part types that hold an image (Hugging Face/Qwen, OpenAI chat, Responses API)."""
VIDEO_PART_TYPES = frozenset({"video", "video_url", "input_video"})
"""Content part types that hold a video (refused: send frames as images)."""
_REF_PREFIX = "sha256:"


def _parts(message: Mapping[str, Any]) -> list[Any]:
    content = message.get("content")
    return content if isinstance(content, list) else []


def _is_image(part: Any) -> bool:
    return isinstance(part, Mapping) and part.get("type") in IMAGE_PART_TYPES


def _is_video(part: Any) -> bool:
    return isinstance(part, Mapping) and part.get("type") in VIDEO_PART_TYPES


def has_images(messages: Sequence[Mapping[str, Any]]) -> bool:
    """Whether any message holds an image (or video) part."""
    return any(_is_image(p) or _is_video(p) for m in messages for p in _parts(m))


def image_refs(messages: Sequence[Mapping[str, Any]]) -> Iterator[str]:
    """The digests of the image parts of ``messages`` kept by :class:`ConversationImages`, in order."""
    for m in messages:
        for p in _parts(m):
            if _is_image(p):
                yield str(p.get("image"))


def image_source(part: Mapping[str, Any]) -> Any:
    """What an image part carries: its payload in any of the forms users write."""
    for key in ("image", "image_url", "url", "bytes", "path"):
        value = part.get(key)
        if value is not None:
            return value.get("url") if isinstance(value, Mapping) and "url" in value else value
    return None


class ConversationImages:
    """The images of one conversation: each decoded and processed once, when it enters.

    Args:
        processor: The model's :class:`VisionProcessor`; None for a text-only model (then any
            image is an error naming the fix).
        limits: Pixel, byte and per-trajectory limits; None: the defaults.
    """

    def __init__(self, processor: VisionProcessor | None, limits: ImageLimits | None = None) -> None:
        self.processor = processor
        self.limits = limits or ImageLimits()
        self.items: dict[str, ImageItem] = {}
        """Every image seen, by digest."""
        self.count = 0
        """Image parts taken so far (an image sent twice counts twice: the model reads it twice)."""
        self._sources: dict[int, tuple[Any, str]] = {}
        """Digest by source object (kept alive here, so its id stays its own): a part previewed
        and then appended, or the same object sent again, is decoded once."""
        self._adopted: dict[str, str] = {}
        """Digest by source text (a data URL) of images processed before they reached the
        messages (:meth:`adopt`)."""

    def adopt(self, source: str, item: ImageItem) -> None:
        """Take ``item``, already processed by this conversation's processor, as what a later
        image part whose source is exactly ``source`` (e.g. the data URL a tool's image was
        written into, so the message stays plain JSON) holds: that part is then neither
        decoded nor processed again. It still counts against ``max_images`` when it enters."""
        self.items.setdefault(item.digest, item)
        self._adopted[source] = item.digest

    def take(self, messages: Sequence[Mapping[str, Any]], *, where: str = "message", count: bool = True) -> list[dict]:
        """``messages`` (copied) with every image part decoded, processed and replaced by
        ``{"type": "image", "image": digest}``; text parts are kept as they are. ``count=False``
        (a preview of messages not yet appended) does not count them against ``max_images``.

        Raises:
            ImageError: a video part (naming what is supported), an image for a model without
                a vision processor, more than ``limits.max_images`` images, or an image that
                :func:`decode_image` refuses.
        """
        out = []
        # Counted over the whole call and committed at its end: a refused image leaves the
        # count as it was, and a preview's images count against the limit among themselves.
        taken = self.count
        for i, message in enumerate(messages):
            parts = _parts(message)
            if not any(_is_image(p) or _is_video(p) for p in parts):
                out.append(dict(message))
                continue
            kept = []
            for j, part in enumerate(parts):
                label = f"{where} {i} ({message.get('role')}), content[{j}]"
                if _is_video(part):
                    raise ImageError(f"{label}: video parts are not supported; send frames as image parts "
                                     "({'type': 'image', ...} or {'type': 'image_url', ...})")
                if _is_image(part):
                    taken += 1
                    kept.append(self._take_part(part, label, taken))
                else:
                    kept.append(part)
            out.append({**message, "content": kept})
        if count:
            self.count = taken
        return out

    def _take_part(self, part: Mapping[str, Any], where: str, taken: int) -> dict:
        if self.processor is None:
            raise ImageError(f"{where}: an image was given to a text-only model; use a vision-language model "
                             "(a checkpoint with a vision processor, e.g. agentloop_engines.testing.tiny_vlm.build_tiny_vlm()) "
                             "or drop the image")
        if taken > self.limits.max_images:
            raise ImageLimitError(f"{where}: more than {self.limits.max_images} images in one trajectory "
                             "(max_images)")
        source = image_source(part)
        if source is None:
            raise ImageError(f"{where}: an image part with no image (keys: {sorted(map(str, part))})")
        known = self._sources.get(id(source))
        if isinstance(source, str) and source.startswith(_REF_PREFIX) and source in self.items:
            return {"type": "image", "image": source}  # a part this conversation already took
        if known is not None and known[0] is source:
            return {"type": "image", "image": known[1]}
        adopted = self._adopted.get(source) if isinstance(source, str) else None
        if adopted is not None:
            return {"type": "image", "image": adopted}
        item = self.processor.process(decode_image(source, self.limits, where=where))
        digest = self.items.setdefault(item.digest, item).digest
        if not isinstance(source, str):
            self._sources[id(source)] = (source, digest)
        return {"type": "image", "image": digest}

    def in_messages(self, messages: Sequence[Mapping[str, Any]]) -> list[ImageItem]:
        """The images of ``messages`` (taken by :meth:`take`), in the order they appear."""
        try:
            return [self.items[ref] for ref in image_refs(messages)]
        except KeyError as exc:
            raise ImageError(f"an image part names {exc.args[0]!r}, which this conversation never took; add "
                             "images through the trajectory, not by editing its messages") from None


def messages_with_row_images(messages: Sequence[Mapping[str, Any]], images: Sequence[Any] | None,
                             *, where: str = "row") -> list[dict]:
    """verl's multimodal rows as content parts: each ``<image>`` marker in a string content
    becomes an image part holding the row's next image, in order (as verl's geo3k preprocessing
    writes them: an ``images`` column of ``{"bytes": ...}`` cells or paths).

    Raises:
        ImageError: when the markers and the images do not pair up, or the row has ``<video>``.
    """
    images = [] if images is None else list(images)  # not `or`: pandas gives a numpy array
    used, out = 0, []
    for message in messages:
        content = message.get("content")
        if isinstance(content, str) and VIDEO_MARKER in content:
            raise ImageError(f"{where}: a <video> marker; videos are not supported, send frames as images")
        if not isinstance(content, str) or IMAGE_MARKER not in content:
            out.append(dict(message))
            continue
        parts: list[dict] = []
        pieces = content.split(IMAGE_MARKER)
        for k, text in enumerate(pieces):
            if k:
                if used >= len(images):
                    raise ImageError(f"{where}: the prompt has more <image> markers than the row's {len(images)} "
                                     "image(s) (column 'images')")
                parts.append({"type": "image", "image": images[used]})
                used += 1
            if text:
                parts.append({"type": "text", "text": text})
        out.append({**message, "content": parts})
    if used != len(images):
        raise ImageError(f"{where}: the row has {len(images)} image(s) (column 'images') but its prompt has {used} "
                         "<image> marker(s); put one marker where each image goes")
    return out


def multi_modal_kwargs(items: Sequence[ImageItem]) -> dict[str, Any]:
    """The keyword arguments a loop passes to ``generate`` for a prompt with ``items``:
    ``{"multi_modal_data": {"image": [...]}}``, or nothing for a text prompt (so an engine
    without the ``vision`` capability is called exactly as before)."""
    return {"multi_modal_data": {"image": list(items)}} if items else {}


def images_of(multi_modal_data: Mapping[str, Any] | None, *, engine: str = "the engine") -> tuple[ImageItem, ...]:
    """The images of a ``generate`` call's ``multi_modal_data`` (``{"image": [ImageItem, ...]}``).

    Raises:
        ValueError: another key (video is not supported), or an entry that is not an
            :class:`ImageItem` (decode and process images where they enter the trajectory).
    """
    if not multi_modal_data:
        return ()
    if not isinstance(multi_modal_data, Mapping):
        raise ValueError(f"multi_modal_data must be a mapping like {{'image': [ImageItem, ...]}}, got "
                         f"{type(multi_modal_data).__name__}")
    unknown = set(multi_modal_data) - {"image"}
    if unknown:
        raise ValueError(f"multi_modal_data has key(s) {sorted(map(str, unknown))}; {engine} takes only 'image' "
                         "(videos are not supported: send frames as images)")
    items = multi_modal_data.get("image") or ()
    if isinstance(items, ImageItem) or not isinstance(items, Sequence):
        raise ValueError("multi_modal_data['image'] must be a list of ImageItem")
    for i, item in enumerate(items):
        if not isinstance(item, ImageItem):
            raise ValueError(f"multi_modal_data['image'][{i}] is a {type(item).__name__}, not an ImageItem; process "
                             "images with the model's VisionProcessor (a Trajectory does it as they enter)")
    return tuple(items)
