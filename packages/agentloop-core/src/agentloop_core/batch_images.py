"""Cutting a row that holds images to fit a batch (``RolloutBatch.from_outputs(truncate=True)``).

An image is all of its tokens or none: the vision tower turns it into exactly its
``num_tokens`` features, so a row holding part of an image's tokens cannot be scored, with the
image or without it. A cut that would split an image's tokens therefore moves to the image's
edge (a response ends before the image, a prompt starts after it), and the images whose tokens
leave the row leave its ``multi_modal_data``. What moves with the cut is the image's own tokens
(and the tile names between a tiled image's runs): rendered ids with mask 0, never generated.

A response cut stays exact: a causal model scores each kept token from the tokens and images
before it, all kept, and each image's features do not depend on the others; so the kept
generated tokens score exactly the engine's log-probs. A prompt cut on the left removes context
the engine saw, with images as without (``algorithm.mask_truncated`` leaves such rows out).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class RowCut:
    """Where a too-long row is cut: keep ``prompt_ids[prompt_start:]`` and
    ``response_ids[:response_end]``."""

    prompt_start: int
    response_end: int
    multi_modal_data: dict[str, Any] | None
    """The row's ``multi_modal_data`` with only the images whose tokens it keeps."""
    images_cut: int = 0
    """How many images left the row with their tokens."""
    images_fit: bool = True
    """False: the row's images did not fill its image tokens before the cut (a loop's bug), so
    none could be kept right; they are all dropped and the row must train nothing."""


def image_spans(ids: Sequence[int], images: Sequence[Any]) -> list[tuple[int, int]] | None:
    """Where each image's tokens lie in ``ids`` (prompt then response), one ``(start, end)``
    per image (:func:`agentloop_core.vision.image_token_runs`); None when they cannot be told.

    The placeholder id is not known here (a batch has no processor): it is the one id whose runs
    in ``ids`` are exactly the images' ``run_lengths``. None when no id is (the images do not
    fill the row's image tokens) or several are.
    """
    from agentloop_core.vision.processor import image_token_runs

    try:
        total = sum(int(item.num_tokens) for item in images)
    except (AttributeError, TypeError, ValueError):
        return None  # not ImageItems
    found = []
    for token, count in Counter(ids).items():
        if count == total:
            try:
                found.append(image_token_runs(ids, images, token))
            except ValueError:
                continue
    return found[0] if len(found) == 1 else None


def cut_row(prompt_ids: Sequence[int], response_ids: Sequence[int], prompt_length: int, response_length: int,
            multi_modal_data: Mapping[str, Any] | None) -> RowCut:
    """Where to cut a row to at most ``prompt_length`` prompt and ``response_length`` response
    tokens (prompt on the left, response on the right), never inside an image's tokens."""
    n_p, n_r = len(prompt_ids), len(response_ids)
    start, end = max(0, n_p - prompt_length), min(n_r, response_length)
    images = list((multi_modal_data or {}).get("image") or ())
    if not images:
        return RowCut(start, end, None if multi_modal_data is None else dict(multi_modal_data))
    spans = image_spans([*prompt_ids, *response_ids], images)
    lo, hi = start, n_p + end  # the kept range of prompt + response
    for s, e in spans or ():
        if s < lo < e:
            lo = e
        if s < hi < e:
            hi = s
    if spans is None or lo > n_p or hi < n_p:  # (an image across the prompt's end: not a rendered row)
        return RowCut(start, end, _with_images(multi_modal_data, []), images_cut=len(images), images_fit=False)
    keep = [item for item, (s, e) in zip(images, spans, strict=True) if lo <= s and e <= hi]
    return RowCut(lo, hi - n_p, _with_images(multi_modal_data, keep), images_cut=len(images) - len(keep))


def _with_images(data: Mapping[str, Any] | None, images: list[Any]) -> dict[str, Any] | None:
    """``data`` with its images replaced (a new dict; the output's own is left as it was); None
    when nothing is left."""
    out = {k: v for k, v in (data or {}).items() if k != "image"}
    if images:
        out["image"] = images
    return out or None


__all__ = ["RowCut", "cut_row", "image_spans"]
