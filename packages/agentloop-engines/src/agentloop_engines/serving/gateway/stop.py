"""Text ``stop`` strings over a token-level engine.

Engines stop on token ids only. A stop string is honoured after generation: the ids are cut
right after the token whose text completes the first stop string, so what is kept is a prefix of
what the engine sampled (the ids and log-probs a trainer sees stay exactly the engine's), and the
returned text ends before the stop string, as OpenAI's does. A stop string that is exactly one
token is also sent to the engine as a stop token id, so generation ends there without waste.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["StopMatch", "find_stop", "normalize_stop", "single_token_stop_ids"]


@dataclass(frozen=True)
class StopMatch:
    """Where the first stop string ends in the generated ids."""

    keep: int
    """How many generated ids to keep: up to and including the token that completed the stop string."""
    text: str
    """The text of the kept ids, cut before the stop string."""
    stop: str
    """The stop string found."""


def normalize_stop(stop: Any) -> list[str]:
    """OpenAI's ``stop`` (None, a string, or a list of strings) as a list.

    Raises:
        ValueError: on another type or an empty string.
    """
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise ValueError(f"'stop' must be a string or a list of strings, got {stop!r}")
    if any(not s for s in stops):
        raise ValueError("'stop' contains an empty string, which would stop before the first token")
    return list(dict.fromkeys(stops))


def _first(text: str, stops: Sequence[str]) -> tuple[int, str] | None:
    found = [(pos, s) for s in stops if (pos := text.find(s)) >= 0]
    return min(found, key=lambda f: (f[0], -len(f[1]))) if found else None


def find_stop(token_ids: Sequence[int], decode: Callable[[Sequence[int]], str],
              stops: Sequence[str]) -> StopMatch | None:
    """Find the token that completes the first stop string.

    Binary search over prefixes (a prefix's text contains a stop string once the token that
    completes it is in), so a long generation costs O(log n) decodes, not n.

    Args:
        token_ids: The generated ids.
        decode: Ids to the text the stop strings are matched in (the response text).
        stops: Stop strings.

    Returns:
        The match, or None when no stop string occurs in the text.
    """
    if not stops or not token_ids or _first(decode(token_ids), stops) is None:
        return None
    lo, hi = 1, len(token_ids)
    while lo < hi:
        mid = (lo + hi) // 2
        if _first(decode(token_ids[:mid]), stops) is None:
            lo = mid + 1
        else:
            hi = mid
    text = decode(token_ids[:lo])
    hit = _first(text, stops)
    assert hit is not None  # the full text matched, and the search ends on a matching prefix
    pos, stop = hit
    return StopMatch(keep=lo, text=text[:pos], stop=stop)


def single_token_stop_ids(tokenizer: Any, stops: Sequence[str]) -> list[int]:
    """Ids of the stop strings that are exactly one token (decoding back to the string), which
    the engine can stop on itself."""
    ids = []
    for stop in stops:
        encoded = list(tokenizer.encode(stop, add_special_tokens=False))
        if len(encoded) == 1 and tokenizer.decode(encoded, skip_special_tokens=False) == stop:
            ids.append(int(encoded[0]))
    return ids
