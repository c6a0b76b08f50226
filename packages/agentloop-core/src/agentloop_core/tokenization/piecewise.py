"""Encode rendered chat text piece by piece between special tokens, remembering each piece.

A fast tokenizer matches its added tokens before it normalizes and pre-tokenizes, so the text
between two special tokens is encoded on its own (the conditions are those of
:func:`~agentloop_core.tokenization.incremental.turn_encoder`). Rendered chat text is made of
few distinct pieces: every prompt of a batch repeats the same system message and tool list,
every delta the same glue and generation prompt; only questions and tool results change. So a
renderer encodes a text by cutting it at its special tokens and looking each piece up; only
pieces never seen go to the tokenizer, all in one call.

It is the tokenizer's own result by construction where those conditions hold, and checked
where they might not: the first :data:`VERIFY` texts of each tokenizer are also encoded whole,
and one difference turns piecewise encoding off for that tokenizer (with a log line saying
why), so the ids a trajectory trains on never depend on it being right.
"""

from __future__ import annotations

import logging
import re
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any

from agentloop_core.tokenization.incremental import turn_encoder

logger = logging.getLogger(__name__)

MAX_PIECES = 8192
"""Pieces remembered per tokenizer; the memory starts afresh when it is full (hot pieces, the
system prompt and the glue, come back at their next use)."""
MAX_PIECE_CHARS = 1 << 16
"""Pieces longer than this are encoded every time and not remembered."""
VERIFY = 16
"""Texts per tokenizer encoded both ways before piecewise encoding is trusted alone."""


class PiecewiseEncoder:
    """``encode(text)`` equal to ``tokenizer.encode(text, add_special_tokens=False)``, by
    pieces between special tokens with a memory of the pieces (see the module doc)."""

    def __init__(self, tokenizer: Any, special_texts: Sequence[str], encode_many: Callable[[list[str]], list[list[int]]]):
        ids = {text: tokenizer.convert_tokens_to_ids(text) for text in special_texts}
        self._special_ids: dict[str, int] = ids
        # Longest first, so where two special tokens start at one place the longer is cut.
        self._split = re.compile("(" + "|".join(re.escape(t) for t in sorted(ids, key=len, reverse=True)) + ")")
        self._encode_many = encode_many
        self._whole = lambda text: list(tokenizer.encode(text, add_special_tokens=False))
        self._pieces: dict[str, tuple[int, ...]] = {}
        self._verified = 0
        self._lock = threading.Lock()
        self.enabled = True
        """False once a piecewise encoding differed from the whole one (then every call encodes whole)."""

    def encode(self, text: str) -> list[int]:
        if not self.enabled:
            return self._whole(text)
        parts = self._split.split(text)
        # The memory is never emptied in place, only replaced by a new one when full, so the
        # pieces this call found in it stay there while it builds its ids (another thread's
        # call, or this one's, may replace it meanwhile).
        pieces, special = self._pieces, self._special_ids
        missing = list(dict.fromkeys(p for i, p in enumerate(parts) if i % 2 == 0 and p and p not in pieces))
        if missing:
            found = dict(zip(missing, map(tuple, self._encode_many(missing)), strict=True))
            with self._lock:
                memory = self._pieces
                if len(memory) + len(missing) > MAX_PIECES:
                    memory = self._pieces = {}
                memory.update((k, v) for k, v in found.items() if len(k) <= MAX_PIECE_CHARS)
        else:
            found = {}
        out: list[int] = []
        for i, part in enumerate(parts):
            if i % 2:
                out.append(special[part])
            elif part:
                got = pieces.get(part)
                out.extend(got if got is not None else found[part])
        if self._verified < VERIFY:
            self._verify(text, out)
        return out

    def _verify(self, text: str, out: list[int]) -> None:
        whole = self._whole(text)
        self._verified += 1
        if whole != out:
            self.enabled = False
            at = next((i for i, (a, b) in enumerate(zip(whole, out, strict=False)) if a != b), min(len(whole), len(out)))
            logger.warning("this tokenizer does not encode text between special tokens on its own (ids differ at "
                           "position %d of %r); every text is encoded whole from now on", at, text[:200])
            out[:] = whole


# Per tokenizer (held weakly, as the template probes are) and its special tokens: the encoder,
# or None where the tokenizer may not encode pieces on their own.
_ENCODERS: weakref.WeakKeyDictionary[Any, dict[tuple, PiecewiseEncoder | None]] = weakref.WeakKeyDictionary()


def piecewise_encoder(tokenizer: Any, special_texts: Sequence[str]) -> PiecewiseEncoder | None:
    """The shared :class:`PiecewiseEncoder` of ``tokenizer``, or None where it cannot be used:
    a tokenizer :func:`turn_encoder` refuses (slow, a subclass that rewrites ``encode``,
    special tokens that strip whitespace, a prefix space on the first piece), no special
    tokens, or a tokenizer that cannot be held weakly."""
    try:
        known = _ENCODERS.setdefault(tokenizer, {})
    except TypeError:
        return None
    key = tuple(special_texts)
    if key not in known:
        encode_many = turn_encoder(tokenizer) if special_texts else None
        known[key] = None if encode_many is None else PiecewiseEncoder(tokenizer, special_texts, encode_many)
    return known[key]
