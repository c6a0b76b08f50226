"""Special-token text inside message content is text, never control tokens.

A chat template writes its own control tokens (``<|im_start|>``, ``<|im_end|>``...) around each
message's content. Rendered to text and encoded whole, a tool result, an environment observation
or a user turn that *contains* such a string would be encoded as the control token itself, so
text from outside could open a system or assistant turn in what the model reads (verl and vLLM
encode it that way). Here the renderer marks those strings in every message it did not get from
the engine before the template sees them, and encodes marked text in two kinds of stretch: the
template's own text (special tokens included) as the tokenizer always encodes it, and each stretch
between two of the template's special tokens that holds a mark with the tokenizer's special
tokens off (``split_special_tokens``), the mark put back to its original string first.

A mark is ``MARK s<k> MARK_END`` for the k-th special token of the renderer (the literal
character ``MARK`` in content is marked too, as ``MARK e MARK_END``), so a marked text holds no
special-token string from content, survives any template filter that keeps characters (``trim``,
``tojson`` without ASCII escapes), and travels through the renderer's text pieces and the
sanity check's reference text unchanged: every consumer encodes it with :meth:`ContentMarks.encode`.

Text without marks, which is any conversation whose content holds no special-token string, is
encoded exactly as before (the same call, the same ids). With marks, the ids equal what the
tokenizer gives the text with only the template's special tokens special wherever it encodes the
text between two special tokens on its own (the condition of
:func:`~agentloop_core.tokenization.incremental.turn_encoder`: fast byte-level BPE tokenizers such
as Qwen's, Llama 3's, gpt-oss's); elsewhere (a prefix space added per piece, special tokens that
strip whitespace) the marked stretch is encoded on its own, which may differ from that ideal at
its ends but is the same in the trajectory and in its sanity check.
"""

from __future__ import annotations

import functools
import re
import threading
import weakref
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

__all__ = ["MARK", "MARK_END", "ContentMarks", "content_marks"]

MARK = "\ue000"
"""Opens a mark (a private-use character: no template writes it)."""
MARK_END = "\ue001"
"""Closes a mark."""

_UNMARK = re.compile(MARK + r"(?:s(\d+)|e)" + MARK_END)
_KEEP_KEYS = frozenset({"role", "type"})
"""Message keys the template reads as structure, never as text shown to the model."""


class ContentMarks:
    """Marks special-token strings in messages and encodes marked rendered text (see the module doc).

    Args:
        tokenizer: The tokenizer that encodes (a processor's ``.tokenizer``).
        special_texts: Its special tokens' strings (``template_probes.special_tokens``).
        encode: The encoding of text without marks (the renderer's; default:
            ``tokenizer.encode(text, add_special_tokens=False)``).
    """

    def __init__(self, tokenizer: Any, special_texts: Sequence[str],
                 encode: Callable[[str], list[int]] | None = None) -> None:
        self.tokenizer = tokenizer
        self.special_texts = tuple(special_texts)
        self._index = {text: i for i, text in enumerate(self.special_texts)}
        longest = sorted(self.special_texts, key=len, reverse=True)
        self._find = re.compile("|".join(re.escape(t) for t in [*longest, MARK]))
        self._specials = re.compile("|".join(re.escape(t) for t in longest)) if longest else None
        self._plain = encode or (lambda text: list(tokenizer.encode(text, add_special_tokens=False)))

    # -- marking ---------------------------------------------------------------------------

    def mark(self, text: str) -> str:
        """``text`` with each special-token string (and each ``MARK``) replaced by its mark."""
        if not self._find.search(text):
            return text
        return self._find.sub(self._mark_one, text)

    def _mark_one(self, found: re.Match[str]) -> str:
        text = found.group(0)
        return f"{MARK}e{MARK_END}" if text == MARK else f"{MARK}s{self._index[text]}{MARK_END}"

    def mark_value(self, value: Any) -> Any:
        """Every string in ``value`` (nested dicts and lists; a dict's ``role`` and ``type`` kept)
        marked; the same object where nothing changed."""
        if isinstance(value, str):
            return self.mark(value)
        if isinstance(value, Mapping):
            out = {k: v if k in _KEEP_KEYS else self.mark_value(v) for k, v in value.items()}
            return value if all(out[k] is v for k, v in value.items()) else out
        if isinstance(value, list | tuple):
            items = [self.mark_value(v) for v in value]
            return value if all(a is b for a, b in zip(items, value, strict=True)) else type(value)(items)
        return value

    def mark_messages(self, messages: Sequence[Mapping[str, Any]], *, generated: Collection[int] = ()) -> list[dict]:
        """Copies of ``messages`` with their text marked, except the messages at ``generated``
        (assistant turns whose content is the engine's decoded output)."""
        keep = set(generated)
        return [dict(m) if i in keep else dict(self.mark_value(m)) for i, m in enumerate(messages)]

    def unmark(self, text: str) -> str:
        """``text`` with every mark back to the string it stands for: the text the model reads."""
        if MARK not in text:
            return text
        return _UNMARK.sub(lambda m: MARK if m.group(1) is None else self.special_texts[int(m.group(1))], text)

    # -- encoding --------------------------------------------------------------------------

    def encode(self, text: str) -> list[int]:
        """Ids of rendered ``text``: the plain encoding where it holds no mark; else each
        stretch between two of the template's special tokens that holds a mark encoded with
        special tokens off, and the rest as plain."""
        if MARK not in text:
            return self._plain(text)
        out: list[int] = []
        plain_from, start = 0, 0
        bounds = [(m.start(), m.end()) for m in self._specials.finditer(text)] if self._specials else []
        for at, end in [*bounds, (len(text), len(text))]:
            if MARK in text[start:at]:
                if start > plain_from:
                    out.extend(self._plain(text[plain_from:start]))
                out.extend(split_encoder(self.tokenizer)(self.unmark(text[start:at])))
                plain_from = at
            start = end
        if plain_from < len(text):
            out.extend(self._plain(text[plain_from:]))
        return out


# Per tokenizer (held weakly): its encoder with special tokens off, where that encoder does not
# refer to the tokenizer (a value that did would keep its key alive).
_SPLITTERS: weakref.WeakKeyDictionary[Any, Callable[[str], list[int]]] = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()


def content_marks(tokenizer: Any, special_texts: Sequence[str] | None = None) -> ContentMarks:
    """A :class:`ContentMarks` for ``tokenizer``, encoding unmarked text with
    ``tokenizer.encode(text, add_special_tokens=False)``.

    Args:
        tokenizer: The tokenizer that encodes (a processor's ``.tokenizer``).
        special_texts: Its special tokens' strings; None: all of them, as a
            :class:`~agentloop_core.tokenization.ChatRenderer` finds them.
    """
    if special_texts is None:
        from agentloop_core.tokenization.template_probes import special_tokens

        special_texts = special_tokens(tokenizer)[0]
    return ContentMarks(tokenizer, special_texts)


def split_encoder(tokenizer: Any) -> Callable[[str], list[int]]:
    """``text -> ids`` with the tokenizer's special tokens encoded as text
    (``split_special_tokens=True``); other added tokens (Qwen's ``<tool_call>``) stay whole.

    A stock fast tokenizer gets its own copy of the backend with special tokens off: transformers
    switches the shared backend's ``encode_special_tokens`` for such a call and leaves it
    switched, which would split the template's own tokens in every encode after it that goes to
    the backend directly (the piecewise encoder does). Any other tokenizer is asked with
    ``split_special_tokens=True`` and its backend switched back.
    """
    try:
        with _LOCK:
            known = _SPLITTERS.get(tokenizer)
            if known is None:
                known = _backend_copy(tokenizer)
                if known is not None:
                    _SPLITTERS[tokenizer] = known
    except TypeError:  # a tokenizer that cannot be held weakly
        known = _backend_copy(tokenizer)
    return known if known is not None else functools.partial(_split_by_kwarg, tokenizer)


def _backend_copy(tokenizer: Any) -> Callable[[str], list[int]] | None:
    """The encoder of a copy of a stock fast tokenizer's backend with special tokens off; None
    for any other tokenizer."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    cls = type(tokenizer)
    stock = all(getattr(getattr(cls, name, None), "__module__", "").startswith("transformers.tokenization_utils")
                for name in ("encode", "_encode_plus"))
    if not (getattr(tokenizer, "is_fast", False) and backend is not None and stock):
        return None
    from tokenizers import Tokenizer

    copy = Tokenizer.from_str(backend.to_str())
    copy.encode_special_tokens = True
    copy.no_truncation()
    copy.no_padding()
    return lambda text: list(copy.encode(text, add_special_tokens=False).ids)


def _split_by_kwarg(tokenizer: Any, text: str) -> list[int]:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    try:
        return list(tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True))
    finally:
        if backend is not None and hasattr(backend, "encode_special_tokens"):
            backend.encode_special_tokens = bool(getattr(tokenizer, "split_special_tokens", False))
