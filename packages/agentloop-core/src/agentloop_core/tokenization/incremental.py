"""The engine-view sanity check without re-encoding the whole trajectory.

In the engine view every mask-0 piece of a trajectory (the prompt, each delta) is the encoding
of its own template render, made when it was appended; the check's reference text is those
same renders joined with the generated texts. So when nothing changed since (the messages, the
attached calls, the renderer's settings, the ids), the reference equals the built text by
construction and only one question is left: whether the built ids are also the canonical
encoding of the joined text (``SanityCheckReport.canonical``). A fast tokenizer answers that
piece by piece: it matches added tokens before it normalizes and pre-tokenizes, so the text
between two special tokens is encoded on its own. Each generated turn is then encoded once
together with the text around it up to the nearest special token on either side (the
generation prompt's ``assistant\\n``, the glue after a turn cut without EOS), which is where a
BPE merge across a piece boundary would show; nothing else is encoded again.

Where that does not hold (a slow tokenizer, a special token that strips the whitespace next to
it, a pre-tokenizer that treats the first piece of text differently, two generated pieces in a
row, a piece without a special token to cut at) the caller falls back to the full re-encode.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterable, Iterator, Sequence
from json.encoder import c_make_encoder, encode_basestring  # type: ignore[attr-defined]
from typing import Any, Protocol

_SPLITS: dict[int, tuple[Any, bool]] = {}
"""Per tokenizer backend (kept alive with its verdict, so its id is not reused)."""


class PieceLike(Protocol):
    """A trajectory piece as the check reads it (``Trajectory``'s own pieces)."""

    @property
    def kind(self) -> str: ...
    @property
    def text(self) -> str: ...
    @property
    def ids(self) -> Sequence[int]: ...


def turn_encoder(tokenizer: Any) -> Callable[[list[str]], list[list[int]]] | None:
    """An encoder of a list of texts (in one call to the fast backend, no offsets) that gives
    what ``tokenizer.encode(text, add_special_tokens=False)`` gives each, when ``tokenizer``
    encodes the text between special tokens on its own; None when it may not.

    That holds for a fast tokenizer that encodes with transformers' stock methods (no subclass
    or wrapper rewriting ids), whose special tokens strip no whitespace next to them, match
    anywhere (not ``single_word``) and before normalization (not ``normalized``), and whose
    normalizer and pre-tokenizer add no prefix space to the first piece of text (Metaspace,
    Prepend, ``add_prefix_space``).
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if not getattr(tokenizer, "is_fast", False) or backend is None:
        return None
    known = _SPLITS.get(id(backend))
    if known is None or known[0] is not backend:
        known = _SPLITS[id(backend)] = (backend, _backend_splits(tokenizer, backend))
    cls = type(tokenizer)
    stock = all(getattr(getattr(cls, name, None), "__module__", "").startswith("transformers.tokenization_utils")
                for name in ("encode", "_encode_plus"))
    if not known[1] or not stock or getattr(tokenizer, "split_special_tokens", False):
        return None
    fast = getattr(backend, "encode_batch_fast", None) or backend.encode_batch
    return lambda texts: [list(e.ids) for e in fast(texts, add_special_tokens=False)]


def plain_decoder(tokenizer: Any) -> Callable[[list[int], bool], str] | None:
    """The fast backend's ``decode(ids, skip_special_tokens)``, which gives what
    ``tokenizer.decode`` gives for a stock fast tokenizer while its
    ``clean_up_tokenization_spaces`` is False (the caller checks that at each call: it can be
    changed in place); None for any other tokenizer. Generated turns are decoded three times a
    turn, and transformers' wrapper around the backend cost three times the decode itself."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    cls = type(tokenizer)
    stock = all(getattr(getattr(cls, name, None), "__module__", "").startswith("transformers.tokenization_utils")
                for name in ("decode", "_decode"))
    if not getattr(tokenizer, "is_fast", False) or backend is None or not stock:
        return None
    return backend.decode


def _backend_splits(tokenizer: Any, backend: Any) -> bool:
    decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
    # A special token that strips whitespace next to it, matches only as a whole word, or is
    # matched after normalization is not a clean cut between two independently encoded texts.
    if any(getattr(t, "special", False) and any(getattr(t, flag, False) for flag in ("lstrip", "rstrip", "single_word", "normalized"))
           for t in decoder.values()):
        return False
    try:
        spec = json.loads(backend.to_str())
    except (AttributeError, TypeError, ValueError):
        return False
    text = json.dumps([spec.get("normalizer"), spec.get("pre_tokenizer")])
    return not any(word in text for word in ('"Metaspace"', '"Prepend"', '"add_prefix_space": true'))


_JSON = json.JSONEncoder(ensure_ascii=False)


def _to_json(value: Any) -> str:
    """``json.dumps(value, ensure_ascii=False)``: the same text and errors without building a
    ``JSONEncoder`` and its wrappers at every call (a trajectory takes ~30 snapshots; that was
    a third of a small dump's time). Each call gets its own circular-reference markers, as
    ``json.dumps`` does, so a failed or concurrent dump cannot leave marks behind."""
    if c_make_encoder is None or isinstance(value, str):
        return _JSON.encode(value)
    return "".join(c_make_encoder({}, _JSON.default, encode_basestring, None, ": ", ", ", False, False, True)(value, 0))


# One encoder for every snapshot: without circular-reference markers it keeps no state between
# calls, so it is built once instead of at every call (a trajectory takes ~30 snapshots; the
# build was a fifth of a small one). A cycle then ends in RecursionError instead of ValueError:
# either way it is not JSON.
_PLAIN = None if c_make_encoder is None else c_make_encoder(
    None, _JSON.default, encode_basestring, None, ": ", ", ", False, False, True)


DIGEST_SIZE = 16
"""Bytes in a :func:`snapshot` digest."""

_NOT_JSON = bytes(DIGEST_SIZE)


def snapshot(value: Any) -> bytes | None:
    """A 128-bit BLAKE2 digest of ``value`` as JSON (dict order kept, the text of
    :func:`_to_json`), to tell later whether it changed without holding a copy of it; None when
    it is not JSON (images, a cycle, nesting past the recursion limit), which nothing can be
    compared by."""
    try:
        encoded = _to_json(value) if _PLAIN is None or isinstance(value, str) else "".join(_PLAIN(value, 0))
    except (TypeError, ValueError, RecursionError):
        return None
    return hashlib.blake2b(encoded.encode("utf-8", "surrogatepass"), digest_size=DIGEST_SIZE).digest()


class Digests:
    """A trajectory's message digests (:func:`snapshot`), in order, packed 16 bytes each into
    one buffer: a trajectory in flight holds one per message, and a ``bytes`` object with its
    list slot costs ~64 bytes where the packed digest costs 16.

    A digest of None (not JSON) is held as 16 zero bytes and reads back as None. A real digest
    of 16 zero bytes (odds 2**-128) would read back as None too, which only sends the check
    down its full render: never a wrong pass.
    """

    __slots__ = ("_packed",)

    def __init__(self, digests: Iterable[bytes | None] = ()) -> None:
        self._packed = bytearray()
        self.extend(digests)

    def append(self, digest: bytes | None) -> None:
        """Add one digest (a :func:`snapshot`: 16 bytes, or None)."""
        if digest is None:
            self._packed += _NOT_JSON
            return
        if not isinstance(digest, bytes) or len(digest) != DIGEST_SIZE:
            raise ValueError(f"a message digest is {DIGEST_SIZE} bytes from snapshot() or None, got {digest!r}")
        self._packed += digest

    def extend(self, digests: Iterable[bytes | None]) -> None:
        for digest in digests:
            self.append(digest)

    def __len__(self) -> int:
        return len(self._packed) // DIGEST_SIZE

    def __iter__(self) -> Iterator[bytes | None]:
        packed = self._packed
        for at in range(0, len(packed), DIGEST_SIZE):
            digest = bytes(packed[at : at + DIGEST_SIZE])
            yield None if digest == _NOT_JSON else digest


def canonical_by_turn(pieces: Sequence[PieceLike], encode: Callable[[list[str]], list[list[int]]],
                      special_pattern: Any,
                      special_ids: frozenset[int]) -> bool | None:
    """Whether the joined ids of ``pieces`` are the canonical encoding of their joined text,
    encoding each generated piece once (``encode`` takes a list of texts) with its neighbours' text up to their nearest special
    token; None when some piece has no such cut (the caller encodes the whole text).

    Assumes ``encode`` from :func:`turn_encoder` and mask-0 pieces whose ids encode their text.
    """
    if special_pattern is None:
        return None
    texts, expected = [], []
    for i, piece in enumerate(pieces):
        if piece.kind != "generated":
            continue
        before = pieces[i - 1]
        last = None if before.kind == "generated" else _last_special(before, special_pattern, special_ids)
        if last is None:
            return None
        tail_text, tail_ids = last
        head_text, head_ids = "", ()
        if i + 1 < len(pieces) and not (piece.ids and piece.ids[-1] in special_ids):
            after = pieces[i + 1]
            first = None if after.kind == "generated" else _first_special(after, special_pattern, special_ids)
            if first is None:
                return None
            head_text, head_ids = first
        texts.append(tail_text + piece.text + head_text)
        expected.append([*tail_ids, *piece.ids, *head_ids])
    return not texts or encode(texts) == expected


def _last_special(piece: PieceLike, pattern: Any, special_ids: frozenset[int]) -> tuple[str, Sequence[int]] | None:
    """The text and ids of ``piece`` after its last special token (None without one)."""
    at = next((j for j in range(len(piece.ids) - 1, -1, -1) if piece.ids[j] in special_ids), None)
    ends = [m.end() for m in pattern.finditer(piece.text)]
    if at is None or not ends:
        return None
    return piece.text[ends[-1]:], piece.ids[at + 1:]


def _first_special(piece: PieceLike, pattern: Any, special_ids: frozenset[int]) -> tuple[str, Sequence[int]] | None:
    """The text and ids of ``piece`` before its first special token (None without one)."""
    at = next((j for j, t in enumerate(piece.ids) if t in special_ids), None)
    found = pattern.search(piece.text)
    if at is None or found is None:
        return None
    return piece.text[: found.start()], piece.ids[:at]
