"""Images that tools and environments return, on their way into the conversation.

A tool's :class:`~agentloop_tools.schema.ToolResponse` images become image parts of its tool
message, images first (in the order the tool returned them), then one text part: verl's order,
and the order a Qwen-VL template renders them in. Each is processed once (by the screen, which
hands the item to the trajectory) and goes to every later ``generate`` call in
``multi_modal_data``.

Nothing a tool returns may end the trajectory, so every image is screened here first
(:class:`MediaScreen`): decoded within the loop's limits (``max_image_pixels``, checked on the
header before any pixel is decoded; ``max_image_bytes``; ``max_images`` per trajectory, prompt
included), then processed (once) by the model's vision processor, which refuses what it cannot read
(Qwen-VL: an aspect ratio over 200, a side under its patch size), and refused with error text
the model reads when it does not pass, when the model has no vision processor, or when it is a
video. Each image is screened on its own: one refused image never costs the others of the turn.
What is refused is counted (:data:`MEDIA_COUNTERS`). A tool message whose images were all
refused before the processor saw them stays a plain string, exactly as for a text-only tool.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from agentloop_core.vision import ConversationImages, ImageError, ImageLimits, VisionProcessor, decode_image
from agentloop_core.vision.content import IMAGE_PART_TYPES, VIDEO_PART_TYPES, image_source

__all__ = ["MEDIA_COUNTERS", "NO_VISION_FIX", "VIDEO_REFUSAL", "MediaScreen", "check_processor", "strip_images",
           "tool_limits"]

MEDIA_COUNTERS = ("tool_images", "tool_images_refused", "tool_images_no_vision", "tool_videos_refused")
"""Per trajectory: images that entered the conversation from tools (or environment steps);
images refused (over a limit, unreadable, or for a text-only model); of those, the ones refused
because the model has no vision processor; videos refused."""

VIDEO_REFUSAL = "videos are not supported; return frames as images"
"""What the model reads when a tool returns a video."""

NO_VISION_FIX = ("this model reads text only (the loop has no vision processor): serve a vision-language "
                 "model so tools can show images, or have the tool describe the image in text")
"""What the model reads when a tool returns an image to a text-only model."""



def check_processor(processor: Any, loop_name: str) -> VisionProcessor | None:
    """The loop's ``processor`` as the renderer's vision processor.

    Raises:
        TypeError: something other than a :class:`~agentloop_core.vision.VisionProcessor` or None.
    """
    if processor is None or isinstance(processor, VisionProcessor):
        return processor
    raise TypeError(f"{loop_name}: processor must be an agentloop_core.vision.VisionProcessor or None, got "
                    f"{type(processor).__name__}; build it with agentloop_core.vision.load_vision_processor("
                    "model_folder, tokenizer)")


class MediaScreen:
    """Screens the images of one turn's tool (or environment) messages before they are
    appended: each is decoded within ``limits``, processed by the model's processor and
    counted against ``max_images``, or refused with text for the model, one image at a time.

    Args:
        processor: The model's vision processor; None: a text-only model (every image is refused).
        limits: The loop's image limits (``allow_paths`` says whether a path is a source).
        taken: Images the trajectory holds already (prompt and earlier turns).
        counters: The run's counters; :data:`MEDIA_COUNTERS` are added to.
        conversation: The trajectory's images (``trajectory.images``): each image is processed
            here (the processor refuses it alone), its item joins the conversation and its part
            names it by digest, so the trajectory neither decodes nor processes it again. None:
            parts hold the decoded image, which the caller processes (see :meth:`processed`).
    """

    def __init__(self, processor: VisionProcessor | None, limits: ImageLimits, taken: int,
                 counters: dict[str, float], conversation: ConversationImages | None = None) -> None:
        self.processor = processor
        self.limits = limits
        self.taken = taken
        self.counters = counters
        self.conversation = conversation

    def image(self, source: Any, where: str) -> tuple[Any | None, str | None]:
        """``(image, None)`` for an image that may enter (the decoded RGB image, or its digest
        with a ``conversation``), else ``(None, error text)``."""
        image, note = self.decoded(source, where)
        return (None, note) if image is None else self.processed(image, where)

    def decoded(self, source: Any, where: str) -> tuple[Any | None, str | None]:
        """``(decoded RGB image, None)`` when ``source`` is within the limits, else
        ``(None, error text)`` (counted as refused)."""
        if self.processor is None:
            self._refuse(no_vision=True)
            return None, f"Error: {where}: {NO_VISION_FIX}."
        if self.taken >= self.limits.max_images:
            self._refuse()
            return None, (f"Error: {where}: more than {self.limits.max_images} images in one trajectory "
                          "(max_images); this image was not shown.")
        try:
            image = decode_image(source, self.limits, where=where)
            # A PIL image handed over lazily (MCP's) is read here, so a corrupt one is refused
            # now rather than failing the processor when the message is rendered.
            image.load()
        except ImageError as exc:
            self._refuse()
            return None, f"Error: {exc}."
        except Exception as exc:  # noqa: BLE001 - any decoder failure means the same to the model
            self._refuse()
            return None, f"Error: {where}: the image data is corrupt ({type(exc).__name__}: {exc})."
        return image, None

    def processed(self, image: Any, where: str) -> tuple[Any | None, str | None]:
        """A decoded image through the model's processor: ``(its digest, None)`` when it takes
        it (counted as shown; the item joins the ``conversation``), else ``(None, error text)``
        (counted as refused). The processor's own checks (Qwen-VL: aspect ratio, smallest side)
        refuse this image alone, here, rather than every image of the turn when the messages
        are rendered. Without a ``conversation`` there is nowhere to keep the item, so the
        image is returned as it is for the caller to process once (LangGraph's tool adapter
        does, refusing each image on its own)."""
        if self.conversation is not None:
            assert self.processor is not None, "decoded() refuses every image without a processor"
            try:
                item = self.processor.process(image)
            except Exception as exc:  # noqa: BLE001 - any processor refusal means the same to the model
                self._refuse()
                return None, (f"Error: an image was not shown ({where}: the model's image processor refused it: "
                              f"{str(exc)[:300]}).")
            image = self.conversation.items.setdefault(item.digest, item).digest
        self.taken += 1
        self.counters["tool_images"] += 1
        return image, None

    def _refuse(self, *, no_vision: bool = False) -> None:
        self.counters["tool_images_refused"] += 1
        self.counters["tool_images_no_vision"] += no_vision

    def videos(self, count: int, what: str) -> str | None:
        """Error text for ``count`` videos from ``what`` (None for none), counted."""
        if not count:
            return None
        self.counters["tool_videos_refused"] += count
        return f"Error: {what} returned {count} video(s); {VIDEO_REFUSAL}."

    def tool_content(self, tool_name: str, text: str, images: Sequence[Any] | None,
                     videos: Sequence[Any] | None) -> str | list[dict[str, Any]]:
        """The content of a tool message: ``text`` (already cut to the response limits) and
        the images as parts before it (an image the processor refuses becomes a text part with
        the error in its place), and a line of error text per image refused before the
        processor (over a limit, unreadable, a text-only model) or video after it (never cut,
        so the model always learns why an image is missing).

        Returns:
            A string when no image reached the processor (as for a text-only tool), else the parts.
        """
        parts: list[dict[str, Any]] = []
        notes = [note for note in [self.videos(len(videos or ()), f"tool {tool_name!r}")] if note]
        if images and self.processor is None:
            for _ in images:
                self._refuse(no_vision=True)
            notes.append(f"Error: tool {tool_name!r} returned {len(images)} image(s), but {NO_VISION_FIX}.")
        else:
            for i, source in enumerate(images or ()):
                where = f"tool {tool_name!r} result image {i}"
                image, note = self.decoded(source, where)
                if image is None:
                    notes.append(note or "")
                    continue
                image, note = self.processed(image, where)
                parts.append({"type": "image", "image": image} if image is not None else {"type": "text", "text": note})
        full = "\n".join(([text] if text else []) + notes)
        if not parts:
            return full
        return [*parts, {"type": "text", "text": full}] if full else parts

    def message(self, message: Mapping[str, Any], where: str, cut: Callable[[str], str]) -> dict[str, Any]:
        """An environment's message with its string content, or each text part of a content
        list, passed through ``cut``; each image part screened (kept decoded, or replaced in
        place by a text part with the error) and each video part replaced by the refusal."""
        content = message.get("content")
        if isinstance(content, str):
            return {**message, "content": cut(content)}
        if not isinstance(content, list):
            return dict(message)
        parts: list[Any] = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, Mapping) else None
            if kind == "text" and isinstance(part.get("text"), str):
                parts.append({**part, "text": cut(part["text"])})
            elif kind in VIDEO_PART_TYPES:
                parts.append({"type": "text", "text": self.videos(1, f"{where}, content[{j}]")})
            elif kind in IMAGE_PART_TYPES:
                image, note = self.image(image_source(part), f"{where}, content[{j}]")
                parts.append({"type": "text", "text": note} if image is None else {"type": "image", "image": image})
            else:
                parts.append(part)
        return {**message, "content": parts}


def strip_images(messages: Sequence[Mapping[str, Any]], reason: str) -> tuple[list[dict[str, Any]], int]:
    """``messages`` with every image part replaced by a text part saying it was refused for
    ``reason``, and how many were replaced: the last resort when the trajectory cannot take a
    turn's images although :class:`MediaScreen` passed each (its processor already refused the
    ones it cannot read, one by one), so the trajectory goes on without them."""
    out, count = [], 0
    for message in messages:
        content = message.get("content")
        if not isinstance(content, list):
            out.append(dict(message))
            continue
        parts = []
        for part in content:
            if isinstance(part, Mapping) and part.get("type") in IMAGE_PART_TYPES:
                count += 1
                parts.append({"type": "text", "text": f"Error: an image was not shown ({reason})."})
            else:
                parts.append(part)
        out.append({**message, "content": parts})
    return out, count


def tool_limits(limits: ImageLimits) -> ImageLimits:
    """The limits of images a tool returns: the loop's, without file paths (a tool's result may
    echo a path the model chose)."""
    return dataclasses.replace(limits, allow_paths=False)
