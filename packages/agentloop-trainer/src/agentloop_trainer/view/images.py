"""A trajectory's images in the viewer: small thumbnails in the records, checked again before the
page shows one.

Writing (:func:`record_images`, for :func:`~agentloop_trainer.view.viewer.trajectory_records`):
each image of a batch row (``multi_modal_data["image"]``, in the order of their tokens) becomes
an entry with its digest, its size as it entered, its token count, the message that carried it
(index and role, from the ``{"type": "image", "image": digest}`` parts of ``messages``), where
its first run of image tokens starts in ``prompt_ids + response_ids`` (``token_start``; every run
as ``token_runs`` for an image of several, :mod:`~agentloop_trainer.view.image_runs`), and a thumbnail: longest side
at most :data:`THUMBNAIL_SIDE` px, PNG or JPEG (whichever is smaller), base64. A record keeps
:data:`MAX_THUMBNAILS` thumbnails and :data:`MAX_IMAGE_ENTRIES` entries at most, and counts
what it left out (``thumbnails_omitted``, ``images_omitted``).

Reading (:func:`check_images`, from :func:`~agentloop_trainer.view.viewer_input.check_records`):
nothing of an entry is trusted. A thumbnail reaches the page only as a ``data:image/...`` URL
built here: the value must be base64 (at most :data:`MAX_THUMBNAIL_CHARS` characters) of bytes
that start with the signature of the type its ``thumbnail_type`` names, which Pillow reads as
that format, at most :data:`MAX_SHOWN_SIDE` px a side; the pixels are then encoded afresh, so
no byte of the file but pixels reaches the page. Token positions must point at runs of one
repeated id (mask 0 in the response; :func:`~agentloop_trainer.view.image_runs.check_token_runs`). Anything else is kept as a
:class:`~agentloop_trainer.view.values.BadValue`, shown marked and listed.
"""

from __future__ import annotations

import base64
import binascii
import io
import re
import warnings
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from agentloop_trainer.view.image_runs import Run, check_token_runs, image_token_places, image_token_starts
from agentloop_trainer.view.values import BadValue, bad_value, is_int

__all__ = ["ShownImage", "check_images", "image_part_digest", "image_places", "image_token_places",
           "image_token_starts", "record_images", "thumbnail", "thumbnail_src"]

THUMBNAIL_SIDE = 128
"""Longest side, in pixels, of the thumbnails :func:`record_images` writes."""
MAX_THUMBNAILS = 16
"""Thumbnails one record keeps (its first images); the others are counted in ``thumbnails_omitted``."""
MAX_IMAGE_ENTRIES = 256
"""Image entries one record keeps; the others are counted in ``images_omitted``."""
MAX_THUMBNAIL_CHARS = 200_000
"""Longest thumbnail (base64 characters) the page takes: a writer's 128 px image is far smaller."""
MAX_SHOWN_SIDE = 256
"""Widest and tallest thumbnail the page takes, in pixels."""

_SIGNATURES = {"png": b"\x89PNG\r\n\x1a\n", "jpeg": b"\xff\xd8\xff"}
_BASE64 = re.compile(r"[A-Za-z0-9+/]*={0,2}")
_DIGEST = re.compile(r"sha256:[0-9a-f]{8,64}")
_MAX_COUNT = 1 << 24  # of tokens or pixels a side: larger is no image of a trajectory


# -- writing ----------------------------------------------------------------------------------


def record_images(multi_modal_data: Any, messages: Any, ids: Sequence[int], tokenizer: Any = None) -> dict[str, Any]:
    """The image fields of one record: ``images`` (and the counts left out); empty without images.

    Args:
        multi_modal_data: The row's ``multi_modal_data`` (``{"image": [ImageItem, ...]}`` or None).
        messages: The row's ``messages`` (image parts name their image by digest).
        ids: ``prompt_ids + response_ids`` of the row, to find each image's runs of tokens.
        tokenizer: Its ``image_token_id`` (or ``image_token``), when it has one, names the
            image token; else the token is found from the runs themselves.
    """
    items = list((multi_modal_data or {}).get("image") or []) if isinstance(multi_modal_data, Mapping) else []
    if not items:
        return {}
    counts = [int(getattr(item, "num_tokens", 0) or 0) for item in items]
    token_places = image_token_places(ids, items, _image_token_id(tokenizer)) or [()] * len(items)
    places = image_places(messages)
    seen: Counter[str] = Counter()
    entries = []
    for k, item in enumerate(items[:MAX_IMAGE_ENTRIES]):
        digest = str(getattr(item, "digest", ""))
        where = places.get(digest, [])
        index, role = where[seen[digest]] if seen[digest] < len(where) else (None, None)
        seen[digest] += 1
        image = getattr(item, "image", None)
        width, height = _size(image)
        runs = token_places[k]
        entry: dict[str, Any] = {"digest": digest, "width": width, "height": height, "num_tokens": counts[k],
                                 "message_index": index, "role": role, "token_start": runs[0][0] if runs else None}
        if len(runs) > 1:  # a tiled image (Idefics3): the page marks each run as this image
            entry["token_runs"] = [list(run) for run in runs]
        if k < MAX_THUMBNAILS:
            entry.update(thumbnail(image))
        entries.append(entry)
    out: dict[str, Any] = {"images": entries}
    if len(items) > MAX_IMAGE_ENTRIES:
        out["images_omitted"] = len(items) - MAX_IMAGE_ENTRIES
    if len(entries) > MAX_THUMBNAILS:
        out["thumbnails_omitted"] = len(entries) - MAX_THUMBNAILS
    return out


def thumbnail(image: Any) -> dict[str, str]:
    """``{"thumbnail": base64, "thumbnail_type": "png" | "jpeg"}`` of a PIL image, longest side
    at most :data:`THUMBNAIL_SIDE` (the smaller encoding of the two); empty for anything else."""
    try:
        from PIL import Image
    except ImportError:  # pragma: no cover - an ImageItem's image is a PIL image
        return {}
    if not isinstance(image, Image.Image):
        return {}
    small = image.convert("RGB")
    small.thumbnail((THUMBNAIL_SIDE, THUMBNAIL_SIDE), Image.Resampling.LANCZOS)
    encoded = {kind: _encode(small, kind) for kind in ("png", "jpeg")}
    kind = min(encoded, key=lambda k: len(encoded[k]))
    return {"thumbnail": base64.b64encode(encoded[kind]).decode("ascii"), "thumbnail_type": kind}


def image_places(messages: Any) -> dict[str, list[tuple[int, str | None]]]:
    """Digest -> where each of its image parts is in ``messages``: (message index, role), in order."""
    places: dict[str, list[tuple[int, str | None]]] = {}
    for index, message in enumerate(messages if isinstance(messages, list) else []):
        if not isinstance(message, Mapping) or not isinstance(message.get("content"), list):
            continue
        role = message.get("role") if isinstance(message.get("role"), str) else None
        for part in message["content"]:
            digest = image_part_digest(part)
            if digest is not None:
                places.setdefault(digest, []).append((index, role))
    return places


def image_part_digest(part: Any) -> str | None:
    """The digest an image part of a message names (``{"type": "image", "image": digest}``), else None."""
    if isinstance(part, Mapping) and part.get("type") == "image" and isinstance(part.get("image"), str):
        return part["image"]
    return None


def _image_token_id(tokenizer: Any) -> int | None:
    token_id = getattr(tokenizer, "image_token_id", None)
    if is_int(token_id):
        return token_id
    token = getattr(tokenizer, "image_token", None)
    if isinstance(token, str):
        try:
            token_id = tokenizer.convert_tokens_to_ids(token)
        except Exception:  # noqa: BLE001 - a hint only: without it the runs name the token
            return None
        return token_id if is_int(token_id) else None
    return None


def _size(image: Any) -> tuple[int | None, int | None]:
    size = getattr(image, "size", None)
    if isinstance(size, tuple) and len(size) == 2 and all(is_int(v) for v in size):
        return size
    return None, None


def _encode(image: Any, kind: str) -> bytes:
    buf = io.BytesIO()
    if kind == "jpeg":
        image.save(buf, format="JPEG", quality=80, optimize=True)
    else:
        image.save(buf, format="PNG", optimize=True)
    return buf.getvalue()


# -- reading ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class ShownImage:
    """One checked image entry of a record: each field its value, a BadValue, or None (absent)."""

    digest: str | BadValue
    width: int | BadValue | None = None
    height: int | BadValue | None = None
    num_tokens: int | BadValue | None = None
    message_index: int | BadValue | None = None
    role: str | BadValue | None = None
    token_start: int | BadValue | None = None
    """Where the image's first run of image tokens starts in ``prompt_ids + response_ids``;
    checked against them."""
    token_runs: tuple[Run, ...] = ()
    """Its checked runs, (start, length) each: one for Qwen-VL, one per tile for Idefics3;
    empty when its tokens are not placed (shown one by one)."""
    src: str | BadValue | None = None
    """The ``data:image/...;base64,`` URL built here from the re-encoded thumbnail; None: none."""


Note = Callable[[str, BadValue], BadValue]


def check_images(record: dict[str, Any], note: Note) -> None:
    """Replace ``record["images"]`` by :class:`ShownImage` entries and check the counts left out;
    every bad value is passed to ``note(field, bad)``. ``prompt_ids``, ``response_ids`` and
    ``response_mask`` must be checked already."""
    for field in ("images_omitted", "thumbnails_omitted"):
        value = record.get(field)
        if value is not None and not (is_int(value) and value >= 0):
            record[field] = note(field, bad_value(value, "not a count"))
    value = record.get("images")
    if value is None:
        record["images"] = []
        return
    if not isinstance(value, list):
        note("images", bad_value(value, "not a list of image entries; no image shown"))
        record["images"] = []
        return
    taken: list[tuple[int, int]] = []
    record["images"] = [_check_entry(record, entry, f"images[{k}]", note, taken) for k, entry in enumerate(value)]


def _check_entry(record: Mapping[str, Any], entry: Any, where: str, note: Note,
                 taken: list[tuple[int, int]]) -> ShownImage:
    if not isinstance(entry, Mapping):
        return ShownImage(digest=note(where, bad_value(entry, "not an image entry (a JSON object)")))
    digest = entry.get("digest")
    if not (isinstance(digest, str) and _DIGEST.fullmatch(digest)):
        digest = note(f"{where}.digest", bad_value(digest, "not an image digest (sha256:<hex>)"))
    counts = {}
    for field in ("width", "height", "num_tokens", "message_index"):
        v = entry.get(field)
        ok = v is None or (is_int(v) and 0 <= v <= _MAX_COUNT and (field == "message_index" or v > 0))
        counts[field] = v if ok else note(f"{where}.{field}", bad_value(v, "not a positive count"
                                                                         if field != "message_index" else "not an index"))
    role = entry.get("role")
    if role is not None and not isinstance(role, str):
        role = note(f"{where}.role", bad_value(role, "not a text"))
    start = entry.get("token_start")
    runs = check_token_runs(record, start, counts["num_tokens"], entry.get("token_runs"), taken)
    if isinstance(runs, BadValue):
        start = note(f"{where}.{'token_start' if entry.get('token_runs') is None else 'token_runs'}", runs)
    src = thumbnail_src(entry.get("thumbnail"), entry.get("thumbnail_type"))
    if isinstance(src, BadValue):
        note(f"{where}.thumbnail", src)
    return ShownImage(digest=digest, role=role, token_start=start, token_runs=runs if isinstance(runs, tuple) else (),
                      src=src, **counts)


def thumbnail_src(value: Any, kind: Any) -> str | BadValue | None:
    """The ``data:image/<kind>;base64,`` URL of a record's thumbnail, re-encoded from its pixels,
    or a BadValue saying why it is refused; None when there is none."""
    if value is None:
        return None
    if not isinstance(value, str):
        return bad_value(value, "a thumbnail must be a base64 string")
    if len(value) > MAX_THUMBNAIL_CHARS:
        return bad_value(value[:200], f"a thumbnail of {len(value)} characters, over the limit of {MAX_THUMBNAIL_CHARS}")
    if kind not in _SIGNATURES:
        return bad_value(kind, "thumbnail_type must be \"png\" or \"jpeg\"")
    if not _BASE64.fullmatch(value):
        return bad_value(value, "a thumbnail must be plain base64 (no URL, no data: prefix)")
    try:
        data = base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        return bad_value(value, "not valid base64")
    if not data.startswith(_SIGNATURES[kind]):
        return bad_value(value, f"not a {kind} image (its bytes do not start with the {kind} signature)")
    try:
        from PIL import Image
    except ImportError:  # pragma: no cover - depends on the environment
        return BadValue("(not checked)", 'thumbnails are shown only after Pillow checks them: '
                        'pip install "agentloop-core[vision]"')
    return _reencode(Image, data, kind)


def _reencode(Image: Any, data: bytes, kind: str) -> str | BadValue:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data), formats=[kind.upper()])  # reads the header only
            width, height = image.size
            if not (0 < width <= MAX_SHOWN_SIDE and 0 < height <= MAX_SHOWN_SIDE):
                return bad_value(f"{width}x{height}", f"a thumbnail over {MAX_SHOWN_SIDE} px a side")
            image.load()
            pixels = image.convert("RGB")
    except Exception as exc:  # noqa: BLE001 - any decoder error means the same: not shown
        return bad_value(f"{type(exc).__name__}: {exc}", f"not a readable {kind} image")
    return f"data:image/{kind};base64," + base64.b64encode(_encode(pixels, kind)).decode("ascii")
