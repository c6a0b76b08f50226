"""Token ids that share one int object per value, so a stored id costs a list slot (8 bytes).

Why: CPython caches only the ints -5..256; every larger token id an engine or a tokenizer
returns (``tolist()``, JSON, a Rust binding) is a fresh 28-byte object. A trajectory keeps its
ids until the batch returns (``response_ids``, then the output), so with thousands in flight
the int objects cost 3.5x the lists that hold them. :func:`shared_ids` maps each id to the one
object of that value in a process-wide table, grown on demand; the result is still a plain
``list[int]``, equal to the input.

:class:`ReadOnlyIds` is the other half: one list of ids that several holders share (the prompt
ids of a GRPO group's n outputs), which refuses to be changed in place so no holder can change
another's.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from operator import itemgetter

_TABLE: list[int] = list(range(257))
"""``_TABLE[i] is`` the one shared object of value ``i``; grown to the largest id seen (36 bytes
per entry: 5.4 MB once per process for a 150k vocabulary)."""

_GROW = 4096
"""The table grows in steps of this many ids."""

_GROW_LOCK = threading.Lock()
"""Held while the table grows: two threads growing it at once would leave ``_TABLE[i] != i``.
Reads need no lock (the table only grows)."""

MAX_SHARED_ID = 1 << 20
"""Ids above this are kept as they are (past every vocabulary in use; a bad id must not grow
the table without bound)."""


def shared_ids(ids: Iterable[int]) -> list[int]:
    """``list(ids)`` with every id in ``0..MAX_SHARED_ID`` replaced by the table's object of the
    same value (equal, and ``is`` the same object as any other shared id of that value).

    Ids that are not all such ints (a negative id, a float, a value past the limit, ``None``)
    come back as a plain copy, unchanged: the engine's output is validated elsewhere, this only
    saves memory. Other integers equal to such an int (a numpy integer, a bool) come back as
    that int.
    """
    out = ids if type(ids) is list else list(ids)
    for _ in range(2):  # the second time after growing the table
        try:
            # A tuple from itemgetter, then a list of exactly its length (map would over-allocate).
            shared = list(itemgetter(*out)(_TABLE)) if len(out) > 1 else [_TABLE[i] for i in out]
        except IndexError:  # an id past the table: grow it (up to the limit), then map again
            if not _grow_to(out):
                break
            continue
        except TypeError:  # not an integer
            break
        # A negative id indexes from the end of the table: it maps to another value. Comparing
        # costs less than the mapping; checking min() first would cost more than it.
        return shared if shared == out else list(out)
    return list(out)


def _grow_to(ids: list[int]) -> bool:
    """Grow the table past the largest of ``ids``; False when that is not an int within the limit."""
    try:
        high = max(ids)
    except TypeError:
        return False
    if type(high) is not int or high > MAX_SHARED_ID:
        return False
    with _GROW_LOCK:
        if high >= len(_TABLE):
            _TABLE.extend(range(len(_TABLE), (high // _GROW + 1) * _GROW))
    return True


class ReadOnlyIds(list):  # noqa: FURB189 (a list subclass on purpose: it must stay a list)
    """A ``list[int]`` that refuses in-place changes, so one list can be shared.

    The outputs of one prompt's samples get the same prompt ids; a list per output cost 8 bytes
    per id per sample (2.7 KB a trajectory for a 336-token prompt). It is still a list
    (``isinstance``, ``==`` with a list, slicing and ``+`` give plain lists, JSON, torch and
    numpy take it); any method that would change it raises :class:`TypeError` naming the fix:
    copy it first (``list(ids)``). It pickles as itself (Ray ships a group's shared prompt once).
    """

    __slots__ = ()

    def _refuse(self, *_: object, **__: object) -> None:
        raise TypeError("these token ids are shared (the prompt ids of every sample of one prompt) and cannot be "
                        "changed in place; copy them first: ids = list(output.prompt_ids)")

    # pyright's ignore: sort's declared overloads bind self to list[T]; this one takes anything.
    append = extend = insert = pop = remove = clear = sort = reverse = _refuse  # pyright: ignore[reportAssignmentType]
    __setitem__ = __delitem__ = __iadd__ = __imul__ = _refuse  # type: ignore[assignment]

    def __reduce__(self) -> tuple[type[ReadOnlyIds], tuple[list[int]]]:
        # pickle's default for a list subclass fills it with extend() after creating it.
        return ReadOnlyIds, (list(self),)

    def __copy__(self) -> ReadOnlyIds:
        return self

    def __deepcopy__(self, memo: dict[int, object]) -> ReadOnlyIds:
        return self  # ints are immutable and so is this list: a copy would only cost memory


__all__ = ["MAX_SHARED_ID", "ReadOnlyIds", "shared_ids"]
