"""Where a trajectory's images lie in its token ids, as the viewer records and then checks them.

An image fills the runs of image tokens its :attr:`~agentloop_core.vision.ImageItem.run_lengths`
name: one run for the Qwen-VL family, one per tile plus one for the global view for
Idefics3/SmolVLM, with the text naming each tile (``<row_1_col_2>``) between them. Writing
(:func:`image_token_places`) asks core's
:func:`~agentloop_core.vision.processor.image_token_runs`, the check every engine applies to a
prompt, so the viewer finds the runs exactly where the engine read them, or none at all.

A record's image entry keeps its first run's start as ``token_start`` and, for an image of
several runs, every run as ``token_runs`` (``[[start, length], ...]``). Reading
(:func:`check_token_runs`) trusts none of it: every run must be one image token repeated (the
same id in all runs of the image), inside the ids, not across the prompt/response boundary,
mask 0 in the response, in order and apart from every other image's runs.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

from agentloop_core.vision.processor import ImageItem, image_token_runs
from agentloop_trainer.view.values import BadValue, bad_value, is_int

Run = tuple[int, int]
"""One run of image tokens: (start in ``prompt_ids + response_ids``, length)."""
MAX_RUNS = 64
"""Most runs one image entry may name: Idefics3 reads at most 6 x 6 tiles and a global view (37)."""


# -- writing ----------------------------------------------------------------------------------


def image_token_places(ids: Sequence[Any], items: Sequence[Any], token_id: int | None = None
                       ) -> list[tuple[Run, ...]] | None:
    """Each image's runs of image tokens in ``ids``, in order, or None when they cannot be told apart.

    The image token is ``token_id`` when the ids fit it; else the one id that occurs exactly as
    often as the images have tokens and whose runs are the images' run lengths in order. An item
    without ``run_lengths`` (not an :class:`~agentloop_core.vision.ImageItem`) fills one run of
    its ``num_tokens``.
    """
    images = [_as_item(item) for item in items]
    lengths = [n for item in images for n in item.run_lengths]
    if not images or min(lengths) <= 0:
        return None
    if token_id is not None and (places := _places(ids, images, token_id)) is not None:
        return places
    total = sum(lengths)
    found = [p for t, n in Counter(ids).items() if n == total and (p := _places(ids, images, t)) is not None]
    return found[0] if len(found) == 1 else None


def image_token_starts(ids: Sequence[Any], counts: Sequence[int], token_id: int | None = None) -> list[int] | None:
    """Where each image's tokens start in ``ids`` (images of one run of ``counts[k]`` tokens
    each, in order), or None when the runs cannot be told apart (:func:`image_token_places`)."""
    items = [ImageItem(image=None, digest="", num_tokens=int(n)) for n in counts]
    places = image_token_places(ids, items, token_id)
    return None if places is None else [runs[0][0] for runs in places]


def _places(ids: Sequence[Any], images: Sequence[ImageItem], token: Any) -> list[tuple[Run, ...]] | None:
    try:
        spans = image_token_runs(ids, images, token)
    except ValueError:  # not this token, or not these images' expansions: nothing is placed
        return None
    out = []
    for (k, _), item in zip(spans, images, strict=True):
        runs = []
        for n in item.run_lengths:
            while ids[k] != token:  # a tile's text; image_token_runs checked every run's length
                k += 1
            runs.append((k, n))
            k += n
        out.append(tuple(runs))
    return out


def _as_item(item: Any) -> ImageItem:
    if isinstance(item, ImageItem):
        return item
    n = getattr(item, "num_tokens", 0)
    return ImageItem(image=None, digest="", num_tokens=n if is_int(n) else 0)


# -- reading ----------------------------------------------------------------------------------


def check_token_runs(record: Mapping[str, Any], start: Any, n: Any, value: Any,
                     taken: list[tuple[int, int]]) -> tuple[Run, ...] | BadValue | None:
    """The checked runs of one image entry (``token_start``, ``num_tokens``, ``token_runs``), a
    BadValue saying why they are refused (its tokens are then shown one by one), or None when
    the entry places no tokens. ``taken`` holds the (start, end) of the runs accepted so far, and
    gets these.

    ``prompt_ids``, ``response_ids`` and ``response_mask`` of ``record`` must be checked already.
    """
    if start is None:
        return None if value is None else bad_value(value, "token_runs without a token_start")
    if not is_int(n):
        return bad_value(start, "a token position without a token count")
    if not is_int(start):
        return bad_value(start, "not a token position; the tokens are shown one by one")
    runs = [(start, n)] if value is None else _runs_of(value)
    if isinstance(runs, str):
        return bad_value(value, f"{runs}; the tokens are shown one by one")
    why = _layout_problem(runs, start, n)
    if why is None:
        prompt, response = record.get("prompt_ids") or [], record.get("response_ids") or []
        ids, mask = list(prompt) + list(response), list(record.get("response_mask") or [])
        why = next((w for run in runs if (w := _run_problem(run, ids, mask, len(prompt), taken)) is not None), None)
        if why is None and len({ids[a] for a, _ in runs}) != 1:
            why = "the runs are of different token ids"
    if why is not None:
        return bad_value(start if value is None else value, f"{why}; the tokens are shown one by one")
    taken.extend((a, a + length) for a, length in runs)
    return tuple(runs)


def _runs_of(value: Any) -> list[Run] | str:
    if not (isinstance(value, list) and 1 <= len(value) <= MAX_RUNS
            and all(isinstance(r, list) and len(r) == 2 and all(is_int(x) for x in r) for r in value)):
        return f"token_runs must be a list of 1 to {MAX_RUNS} [start, length] pairs of integers"
    return [(int(a), int(b)) for a, b in value]


def _layout_problem(runs: Sequence[Run], start: int, n: int) -> str | None:
    if runs[0][0] != start:
        return f"the first run starts at {runs[0][0]}, not at token_start {start}"
    if any(length <= 0 for _, length in runs):
        return "a run of no tokens"
    if sum(length for _, length in runs) != n:
        return f"runs of {sum(length for _, length in runs)} tokens for an image of {n}"
    if any(b[0] <= a[0] + a[1] for a, b in zip(runs, runs[1:], strict=False)):
        return "runs out of order, overlapping or touching"
    return None


def _run_problem(run: Run, ids: Sequence[Any], mask: Sequence[Any], P: int,
                 taken: Sequence[tuple[int, int]]) -> str | None:
    start, n = run
    if start < 0 or start + n > len(ids):
        return f"not a position of {n} tokens within the {len(ids)} token ids"
    if len({ids[k] for k in range(start, start + n)}) != 1 or not is_int(ids[start]):
        return f"tokens {start}..{start + n - 1} are not one image token repeated"
    if start < P < start + n:
        return "a run of image tokens across the prompt/response boundary"
    if start >= P and any(mask[k - P] != 0 for k in range(start, start + n) if k - P < len(mask)):
        return "image tokens in the response must have mask 0"
    if any(start < b and a < start + n for a, b in taken):
        return "overlaps another image's tokens"
    return None
