"""How a long tool response is cut before the model reads it; shared by every loop that runs
tools (``tool_agent``, LangGraph's ``react_agent``).

Two limits, each optional, both applied when both are set: characters (:func:`truncate_text`,
``max_tool_response_length``) and tokens of the loop's tokenizer (:func:`truncate_tokens`,
``max_tool_response_tokens``). Either returns text: the loop renders the (cut) tool message
with the chat template like any other, so the trajectory's tokens stay what the template and
tokenizer give for its messages; no token ids are spliced here.
"""

from __future__ import annotations

import os
from typing import Any, Literal, NamedTuple

from agentloop_tools.per_tokenizer import longest_token_chars

__all__ = ["TRUNCATION_MARKER", "CutResponse", "TruncateSide", "cut_tool_response", "truncate_text", "truncate_tokens"]

TruncateSide = Literal["left", "right", "middle"]
"""Which part of a long text to keep: ``left`` keeps the tail, ``right`` the head, ``middle``
head and tail."""

TRUNCATION_MARKER = "...(truncated)..."
"""Written where text was cut, so the model knows the response is incomplete."""


def truncate_text(text: str, limit: int, side: TruncateSide) -> str:
    """Keep at most ``limit`` characters of ``text``, marking the cut.

    Args:
        text: The tool response.
        limit: Characters of ``text`` to keep.
        side: ``left`` keeps the tail, ``right`` the head, ``middle`` both ends.

    Returns:
        ``text`` itself when it fits, else the kept part(s) joined by :data:`TRUNCATION_MARKER`.
    """
    if len(text) <= limit:
        return text
    if side == "left":
        return TRUNCATION_MARKER + text[len(text) - limit :]
    if side == "right":
        return text[:limit] + TRUNCATION_MARKER
    head = limit // 2
    return text[:head] + TRUNCATION_MARKER + text[len(text) - (limit - head) :]


def _encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))


def _head(text: str, decoded: str) -> str:
    """The longest prefix of ``text`` that ``decoded`` (the decoded first tokens) also starts
    with: a token cut inside a character decodes to U+FFFD, which the text does not have."""
    return os.path.commonprefix([text, decoded])


def _tail(text: str, decoded: str) -> str:
    end = text[max(0, len(text) - len(decoded)):]  # reverse only this much: text may be megabytes
    n = len(os.path.commonprefix([end[::-1], decoded[::-1]]))
    return text[len(text) - n:] if n else ""


def truncate_tokens(text: str, limit: int, side: TruncateSide, tokenizer: Any) -> str:
    """Keep at most ``limit`` tokens of ``text`` (as ``tokenizer`` encodes it on its own, no
    special tokens added), cutting on token boundaries and marking the cut.

    The marker's tokens count in ``limit``; when there is no room for the marker and some text,
    the text is cut unmarked (``middle`` then keeps the head: joined unmarked, two ends would read
    as one text). The kept parts are the text's own characters (a prefix and/or a suffix), and the
    result is re-encoded to check it fits: tokens can merge across the joins, so the kept part
    shrinks until it does.

    Only a window of ``limit * longest_token_chars(tokenizer)`` characters at each kept end is
    encoded (a longer text cannot fit in ``limit`` tokens), so a 10 MB response costs the same
    as a 100 kB one.

    Args:
        text: The tool response.
        limit: Most tokens of the result, >= 1.
        side: ``left`` keeps the tail, ``right`` the head, ``middle`` both ends.
        tokenizer: The loop's tokenizer (``encode(text, add_special_tokens=False)``, ``decode``).

    Returns:
        ``text`` itself when it fits, else the kept part(s) and :data:`TRUNCATION_MARKER`.
    """
    window = limit * longest_token_chars(tokenizer)
    if len(text) <= window and len(_encode(tokenizer, text)) <= limit:
        return text
    marker = TRUNCATION_MARKER if len(_encode(tokenizer, TRUNCATION_MARKER)) < limit else ""
    if not marker and side == "middle":  # unmarked, head + tail would read as one text
        side = "right"
    head_ids = _encode(tokenizer, text[:window]) if side != "left" else []
    tail_ids = _encode(tokenizer, text[-window:]) if side != "right" else []
    keep = limit - len(_encode(tokenizer, marker)) if marker else limit
    while True:
        n_head = keep if side == "right" else 0 if side == "left" else keep // 2
        n_tail = keep - n_head
        head = _head(text, tokenizer.decode(head_ids[:n_head], skip_special_tokens=False)) if n_head else ""
        tail = _tail(text, tokenizer.decode(tail_ids[len(tail_ids) - n_tail:], skip_special_tokens=False)) \
            if n_tail else ""
        cut = head + marker + tail
        over = len(_encode(tokenizer, cut)) - limit
        if over <= 0 or keep == 0:
            return cut
        keep = max(0, keep - over)


class CutResponse(NamedTuple):
    """A tool response after both limits, and which of them cut it."""

    text: str
    """What the model reads."""
    by_length: bool
    """``max_tool_response_length`` cut it."""
    by_tokens: bool
    """``max_tool_response_tokens`` cut it."""


def cut_tool_response(text: str, side: TruncateSide, *, max_length: int | None, max_tokens: int | None,
                      tokenizer: Any = None) -> CutResponse:
    """Apply the character limit, then the token limit (each skipped when None).

    Characters go first: it is cheap and bounds the text the tokenizer sees. Both cut the same
    side, so the second cut keeps the first one's marker or removes it with the text around it.

    Raises:
        ValueError: ``max_tokens`` is set and ``tokenizer`` is None.
    """
    out = text if max_length is None else truncate_text(text, max_length, side)
    by_length = out is not text  # truncate_text returns the text itself when it fits
    if max_tokens is None:
        return CutResponse(out, by_length, False)
    if tokenizer is None:
        raise ValueError("max_tool_response_tokens needs the loop's tokenizer to count tokens; pass tokenizer=")
    cut = truncate_tokens(out, max_tokens, side, tokenizer)
    return CutResponse(cut, by_length, cut is not out)
