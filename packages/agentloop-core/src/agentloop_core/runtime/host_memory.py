"""Hand the heap's freed memory back to the operating system at a phase boundary.

glibc's malloc keeps what a process frees: blocks under its (adaptive, up to 32 MB) mmap
threshold go back to the arena they came from, and an arena only returns its top. A CPU
training process moves through phases whose peaks are all made of such blocks (a decode's
key/value caches, an update's activations, an evaluation's 128 rows), and each thread allocates
from an arena of its own (HFServer decodes on its engine thread, the update runs on the main
one), so without a trim the process stays at the sum of its phases' peaks rather than the
largest. On the real-model recipe (SmolLM2-135M, 2 CPUs) a GRPO step held 8.9-13.0 GB where a
trim after the rollout left 1.8 GB and one after the update 4.2 GB (bench/README 10g).

``malloc_trim(0)`` releases the free pages of every arena (glibc >= 2.8), costing about half a
second per ~5 GB of heap; elsewhere (macOS, musl) there is nothing to call and this only
collects garbage.

A trim cannot help inside a phase. An evaluation's 128 decoding rows allocate tens of MB a step
(the last position's logits, key/value tensors as rows finish and join) in sizes that drift by
a row or a column, below glibc's adaptive mmap threshold (which rises to 32 MB as large blocks
are freed), so each new size leaves the last one's hole behind: 9.8 GB resident for 4.2 GB in
use. :func:`map_large_blocks` fixes the threshold instead: blocks from that size up are mapped
from the OS and unmapped when freed.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc

__all__ = ["MAX_MMAP_THRESHOLD", "map_large_blocks", "release_host_memory"]

M_MMAP_THRESHOLD = -3
"""``mallopt``'s parameter number for the mmap threshold (malloc.h)."""
MAX_MMAP_THRESHOLD = 32 << 20
"""The largest threshold glibc accepts on a 64-bit system (``DEFAULT_MMAP_THRESHOLD_MAX``)."""


def release_host_memory() -> None:
    """Collect Python garbage, then return the freed heap pages of every malloc arena to the OS
    (glibc's ``malloc_trim``); a no-op beyond the collection where libc is not glibc."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):  # not glibc (macOS, musl): nothing to trim
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def map_large_blocks(threshold_bytes: int) -> bool:
    """Have glibc map every allocation of at least ``threshold_bytes`` from the OS and unmap it
    when freed (``mallopt(M_MMAP_THRESHOLD)``, which also turns the adaptive threshold off), for
    the whole process from now on.

    Returns:
        Whether the setting took (False where libc is not glibc).

    Raises:
        ValueError: ``threshold_bytes`` is not in (0, 32 MB], the range glibc accepts.
    """
    if not 0 < threshold_bytes <= MAX_MMAP_THRESHOLD:
        raise ValueError(f"mmap threshold {threshold_bytes} bytes: glibc takes 1 byte to {MAX_MMAP_THRESHOLD} "
                         "(32 MB); pass a size in that range")
    try:
        return bool(ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, int(threshold_bytes)))
    except (OSError, AttributeError):  # not glibc
        return False
