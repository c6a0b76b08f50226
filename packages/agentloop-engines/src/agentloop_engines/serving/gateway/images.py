"""Images in chat requests: what a client may send, and how it reaches the engine.

A user or tool message may hold OpenAI image parts
(``{"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}``, or the
Responses API's ``{"type": "input_image", "image_url": "data:..."}``). Each image is decoded
within the gateway's :class:`~agentloop_core.vision.ImageLimits` by core's
:func:`~agentloop_core.vision.decode_image` (the pixel limit is checked on the header, so a
decompression bomb costs nothing) and handed to the rendering decoded; core's
:class:`~agentloop_core.vision.ConversationImages` (a session's
:class:`~agentloop_core.tokenization.Trajectory` holds one) processes it with the model's
:class:`~agentloop_core.vision.VisionProcessor`, and each placeholder the chat template writes
is expanded to its image's tokens. ``generate`` then gets ``multi_modal_data={"image": items}``:
exactly the images of the prompt, in the order of their tokens.

Refused with a 400 naming the reason: a data URL that is not an image, is corrupt or is over a
limit (the gateway's ``max_image_pixels``, ``max_image_bytes``); a remote ``http(s)`` URL
unless ``allow_remote_image_urls``; a file path (always: a client must not make the server read
its files); more images in one request than ``max_images``; an image in a system or assistant
message; a video; and any image when the model has no vision processor or the engine does not
declare ``capabilities.vision``.

A client that resends its whole conversation every turn resends its images too: within a
session, decoded images are kept by a digest of their URL string (least recently used dropped
past 256 MiB of pixels, all dropped when the session is taken), so each is decoded once.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from agentloop_core.vision import (
    ConversationImages,
    ImageError,
    ImageItem,
    ImageLimits,
    VisionProcessor,
    decode_image,
    load_vision_processor,
)

logger = logging.getLogger(__name__)

__all__ = ["IMAGE_ROLES", "GatewayImages", "content_parts", "count_images", "digested", "recorded_request",
           "resolve_vision", "sized_messages", "url_digest"]

IMAGE_ROLES = ("user", "tool")
"""Roles whose messages may hold images: OpenAI's user messages, and tool results (screenshots,
zoomed crops), which vLLM accepts too."""
DECODED_CACHE_BYTES = 256 * 2**20
"""Decoded pixels kept for sessions' resent images, all sessions together (RGB bytes)."""

_IMAGE_PARTS = frozenset({"image_url", "input_image"})
_TEXT_PARTS = frozenset({"text", "input_text"})
_VIDEO_PARTS = frozenset({"video", "video_url", "input_video"})
_NO_VISION = ("this model reads text only: the gateway has no vision processor for it ({why}); serve a "
              "vision-language checkpoint (its folder's processor is loaded with the tokenizer), pass "
              "Gateway(..., vision=load_vision_processor(folder, tokenizer)), or send the request without images")


def url_digest(url: str) -> str:
    """``sha256:`` + 32 hex digits of an image URL's text: its name in caches and comparisons."""
    return "sha256:" + hashlib.sha256(url.encode("utf-8", "surrogatepass")).hexdigest()[:32]


def _part_url(part: Mapping[str, Any]) -> Any:
    """The URL an image part carries (``image_url`` as an object with ``url``, or as text)."""
    value = part.get("image_url")
    return value.get("url") if isinstance(value, Mapping) else value


def content_parts(content: Sequence[Any], where: str, role: str) -> list[dict[str, Any]] | None:
    """The parts of a list ``content`` as the gateway renders them.

    Args:
        content: The message's ``content`` list.
        where: The message, for errors (``messages[2]``).
        role: The message's role.

    Returns:
        None when every part is text (the caller joins them, as it always has); else the text
        parts (``{"type": "text", "text"}``) and image parts
        (``{"type": "image_url", "image_url": {"url"}}``, ``detail`` dropped: the model's
        processor decides the resolution), in order.

    Raises:
        ValueError: an image in a message of another role than user or tool, an image part
            without a URL, a video, or a part of another type, naming the part.
    """
    parts: list[dict[str, Any]] = []
    images = 0
    for j, part in enumerate(content):
        here = f"{where}.content[{j}]"
        kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
        if kind in _TEXT_PARTS:
            if not isinstance(part.get("text"), str):
                raise ValueError(f"{here} is a text part whose 'text' is not a string")
            parts.append({"type": "text", "text": part["text"]})
        elif kind in _IMAGE_PARTS:
            if role not in IMAGE_ROLES:
                raise ValueError(f"{here} is an image in a {role!r} message; images go in user messages (or tool "
                                 "results)")
            url = _part_url(part)
            if not isinstance(url, str) or not url:
                raise ValueError(f"{here} is an image part without a URL; send {{\"type\": \"image_url\", "
                                 "\"image_url\": {\"url\": \"data:image/png;base64,...\"}}")
            parts.append({"type": "image_url", "image_url": {"url": url}})
            images += 1
        elif kind in _VIDEO_PARTS:
            raise ValueError(f"{here} is a {kind!r} part: videos are not supported; send frames as image_url parts")
        else:
            raise ValueError(f"{here} is a {str(kind)[:40]!r} content part; the gateway takes text and image_url "
                             "parts")
    return parts if images else None


def _image_parts(messages: Any) -> Iterator[tuple[int, int, Mapping[str, Any]]]:
    """``(message index, part index, part)`` of every image part of raw or parsed messages."""
    if not isinstance(messages, list):
        return
    for i, message in enumerate(messages):
        content = message.get("content") if isinstance(message, Mapping) else None
        if isinstance(content, list):
            for j, part in enumerate(content):
                if isinstance(part, Mapping) and part.get("type") in _IMAGE_PARTS:
                    yield i, j, part


def count_images(messages: Any) -> int:
    """Image parts in ``messages`` (an image sent twice counts twice: the model reads it twice)."""
    return sum(1 for _ in _image_parts(messages))


def _with_urls(messages: Any, new_url: Callable[[str], str]) -> Any:
    """``messages`` with each image part's URL text replaced by ``new_url(url)`` (only messages
    and parts that change are copied; anything not shaped as an image part is left as it is)."""
    found = list(_image_parts(messages))
    if not found:
        return messages
    out = list(messages)
    for i, j, part in found:
        url = _part_url(part)
        if not isinstance(url, str):
            continue
        value = part.get("image_url")
        value = {**value, "url": new_url(url)} if isinstance(value, Mapping) else new_url(url)
        if out[i] is messages[i]:
            out[i] = {**messages[i], "content": list(messages[i]["content"])}
        out[i]["content"][j] = {**part, "image_url": value}
    return out


def sized_messages(messages: Any) -> Any:
    """``messages`` as the prompt-size limit counts them: an image's URL is never rendered or
    tokenized (the image's own limits and the request's byte limit bound it), so it counts as
    empty; the parts' structure still counts."""
    return _with_urls(messages, lambda url: "")


def digested(messages: Any) -> Any:
    """``messages`` with each image URL replaced by its :func:`url_digest`: how messages compare
    (a resent conversation holds the same images) without holding or comparing the payloads."""
    return _with_urls(messages, url_digest)


def recorded_request(body: Mapping[str, Any]) -> dict[str, Any]:
    """A request body as a session records it: image URLs replaced by their digest and length,
    so a session of many turns that resend the same images does not hold each one every turn."""
    out = dict(body)
    if "messages" in out:
        out["messages"] = _with_urls(out["messages"], lambda url: f"<image {url_digest(url)}, {len(url)} chars>")
    return out


def resolve_vision(vision: Any, tokenizer: Any, server: Any) -> tuple[VisionProcessor | None, str]:
    """The gateway's vision processor and, without one, why.

    Args:
        vision: A :class:`VisionProcessor`; None (text only); or ``"auto"``: loaded with
            :func:`~agentloop_core.vision.load_vision_processor` from the folder the tokenizer
            came from (its ``name_or_path``), else the server's ``model_name`` when that is a
            folder (an ``HFServer`` built from a checkpoint folder).
        tokenizer: The gateway's tokenizer or processor.
        server: The gateway's server.

    Raises:
        TypeError: for another kind of ``vision``.
    """
    if vision is None:
        return None, "Gateway(vision=None)"
    if isinstance(vision, VisionProcessor):
        return vision, ""
    if vision != "auto":
        raise TypeError(f"vision must be a VisionProcessor, None or 'auto', got {type(vision).__name__}; build one "
                        "with agentloop_core.vision.load_vision_processor(model_folder, tokenizer)")
    inner = getattr(tokenizer, "tokenizer", None)
    names = [getattr(tokenizer, "name_or_path", None), getattr(inner, "name_or_path", None),
             getattr(server, "model_name", None)]
    folders = [Path(n) for n in names if isinstance(n, str) and n and (Path(n) / "config.json").is_file()]
    if not folders:
        return None, "no checkpoint folder to load one from"
    try:
        processor = load_vision_processor(folders[0], inner if hasattr(inner, "convert_tokens_to_ids") else tokenizer)
    except Exception as exc:  # noqa: BLE001 - text requests must still be served; images get the reason
        logger.warning("the gateway serves text only: loading the vision processor of %s failed: %s: %s",
                       folders[0], type(exc).__name__, exc)
        return None, f"loading it from {folders[0]} failed: {type(exc).__name__}: {exc}"
    return processor, "" if processor is not None else f"{folders[0]} is a text-only checkpoint"


class _DecodedImages:
    """Decoded images by (session, URL digest), least recently used dropped past ``max_bytes``."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._entries: OrderedDict[tuple[str, str], tuple[Any, int]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def get(self, key: tuple[str, str]) -> Any:
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                return None
            self._entries.move_to_end(key)
            return entry[0]

    def put(self, key: tuple[str, str], image: Any) -> None:
        size = image.size[0] * image.size[1] * 3
        if size > self.max_bytes:
            return
        with self._lock:
            old = self._entries.pop(key, None)
            self._bytes += size - (old[1] if old is not None else 0)
            self._entries[key] = (image, size)
            while self._bytes > self.max_bytes:
                _, (_, dropped) = self._entries.popitem(last=False)
                self._bytes -= dropped

    def forget(self, session_id: str) -> None:
        with self._lock:
            for key in [k for k in self._entries if k[0] == session_id]:
                self._bytes -= self._entries.pop(key)[1]


class GatewayImages:
    """The images side of a gateway: its vision processor, its limits and its decoded images.

    Args:
        vision: See :func:`resolve_vision`.
        limits: Pixel, byte and per-conversation limits, and whether remote URLs are fetched
            (the gateway's ``max_image_pixels``, ``max_image_bytes``, ``max_images``,
            ``allow_remote_image_urls``); None: :class:`ImageLimits`' defaults. File paths are
            refused whatever ``limits.allow_paths`` says.
        tokenizer: The gateway's tokenizer (where ``"auto"`` looks for the checkpoint folder).
        server: The gateway's server (whose ``capabilities.vision`` is checked per request).
        cache_bytes: Decoded pixels kept for resent images (see :data:`DECODED_CACHE_BYTES`).
    """

    def __init__(self, vision: Any, limits: ImageLimits | None, tokenizer: Any, server: Any, *,
                 cache_bytes: int = DECODED_CACHE_BYTES) -> None:
        # Never a path: a client must not make the server read its files, whatever the limits say.
        self.limits = replace(limits if limits is not None else ImageLimits(), allow_paths=False)
        self.vision, self._why_none = resolve_vision(vision, tokenizer, server)
        self.server = server
        self._decoded = _DecodedImages(cache_bytes)
        self.decoded = 0
        """Images decoded so far (monotonic): a session that resends an image does not add to it."""

    def admit(self, messages: Sequence[Mapping[str, Any]]) -> int:
        """Check that a request's images may be served at all; return how many it holds.

        Raises:
            ValueError: images for a model without a vision processor or an engine without the
                ``vision`` capability, or more than ``max_images`` of them.
        """
        n = count_images(messages)
        if not n:
            return 0
        if self.vision is None:
            raise ValueError(_NO_VISION.format(why=self._why_none))
        capabilities = getattr(self.server, "capabilities", None)
        if not getattr(capabilities, "vision", False):
            raise ValueError(f"the engine ({type(self.server).__name__}) does not declare capabilities.vision, so it "
                             "cannot take images; serve the vision-language model on an engine that does (hf, vllm, "
                             "sglang), or send the request without images")
        if n > self.limits.max_images:
            raise ImageError(f"the request holds {n} images; the limit is {self.limits.max_images} per conversation "
                             "(max_images: raise it with Gateway(max_images=...))")
        return n

    def sources(self, messages: Sequence[Mapping[str, Any]], session_id: str | None, *,
                first: int = 0) -> list[dict[str, Any]]:
        """``messages`` with each image part decoded: ``{"type": "image", "image": <PIL image>}``,
        ready for :class:`ConversationImages` (the same URL twice gives the same image object,
        which it processes once).

        Args:
            messages: Parsed messages (see :func:`content_parts`).
            session_id: The session whose decoded images are reused (None: this request's only).
            first: The index of ``messages[0]`` in the request, for errors.

        Raises:
            ImageError: a refused source (remote URL, path), a corrupt image, or one over a limit,
                naming the part and the limit.
        """
        out = [{**m, "content": list(m["content"])} if isinstance(m.get("content"), list) else dict(m)
               for m in messages]
        seen: dict[str, Any] = {}
        for i, j, part in _image_parts(out):
            url = _part_url(part)
            digest = url_digest(url)
            image = seen.get(digest)
            if image is None:
                image = seen[digest] = self._decode(url, digest, session_id, f"messages[{first + i}].content[{j}]")
            out[i]["content"][j] = {"type": "image", "image": image}
        return out

    def _decode(self, url: str, digest: str, session_id: str | None, where: str) -> Any:
        key = (session_id, digest) if session_id is not None else None
        image = self._decoded.get(key) if key is not None else None
        if image is not None:
            return image
        if url[:8].lower().startswith(("http://", "https://")) and not self.limits.allow_remote_urls:
            raise ImageError(f"{where}: remote image URLs are refused ({url[:60]!r}); send the image as a data URL "
                             "(data:image/png;base64,...), or start the gateway with allow_remote_image_urls=True "
                             "where the machine may fetch them")
        image = decode_image(url, self.limits, where=where)
        self.decoded += 1
        if key is not None:
            self._decoded.put(key, image)
        return image

    def take(self, messages: Sequence[Mapping[str, Any]],
             session_id: str | None) -> tuple[list[dict[str, Any]], tuple[ImageItem, ...]]:
        """A whole request's messages with images as core keeps them (``{"type": "image",
        "image": "sha256:..."}``), and its images processed, in order."""
        images = ConversationImages(self.vision, self.limits)
        refs = images.take(self.sources(messages, session_id), where="message")
        return refs, tuple(images.in_messages(refs))

    def render_request(self, render: Callable[..., list[int]],
                       req: Any) -> tuple[list[int], tuple[ImageItem, ...]]:
        """A request outside a session with images: its prompt ids (``render`` is the gateway's
        whole render, see :data:`~agentloop_engines.serving.gateway.chat_planner.RenderWhole`) and images."""
        self.admit(req.messages)
        refs, images = self.take(req.messages, None)
        return render(refs, req.tools, req.chat_template_kwargs, images=images), images

    def expand(self, text: str, items: Sequence[ImageItem]) -> str:
        """A rendered prompt with each image placeholder expanded to its image's tokens."""
        if self.vision is None:
            raise ValueError(_NO_VISION.format(why=self._why_none))
        return self.vision.expand(text, items, where="the rendered prompt")

    def forget(self, session_id: str) -> None:
        """Drop a session's decoded images (it was taken)."""
        self._decoded.forget(session_id)

