"""``release_host_memory`` hands a phase's freed heap back to the OS: a process that freed most
of a heap of 1 MB blocks (below glibc's raised mmap threshold, so they live in an arena) stays
at the heap's size until the trim. ``map_large_blocks`` keeps such blocks off the heap: freed,
they go back at once."""

from __future__ import annotations

import platform
import subprocess
import sys
import textwrap

import pytest

PROBE = textwrap.dedent("""
    import ctypes, json
    from agentloop_core.runtime.host_memory import release_host_memory

    def rss_mb():
        return int(open("/proc/self/statm").read().split()[1]) * 4096 / 2**20

    malloc = ctypes.CDLL("libc.so.6").malloc
    malloc.restype = ctypes.c_void_p
    free = ctypes.CDLL("libc.so.6").free
    free.argtypes = [ctypes.c_void_p]
    memset = ctypes.memset
    # Freeing an mmapped 8 MB block raises glibc's mmap threshold to 8 MB: the 1 MB blocks
    # below come from the heap, as a decode's or an update's mid-sized tensors do.
    free(malloc(8 << 20))
    blocks = [malloc(1 << 20) for _ in range(400)]
    for b in blocks:
        memset(b, 1, 1 << 20)  # touched: resident
    for b in blocks[:-1]:
        free(b)  # the last one pins the heap's top: glibc's own top trim cannot return the rest
    before = rss_mb()
    release_host_memory()
    print(json.dumps({"before": before, "after": rss_mb()}))
""")

GLIBC = pytest.mark.skipif(sys.platform != "linux" or platform.libc_ver()[0] != "glibc", reason="glibc's malloc only")


def _probe(code: str) -> dict[str, float]:
    import json

    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    return json.loads(out.stdout.strip().splitlines()[-1])


@GLIBC
def test_the_freed_heap_goes_back_to_the_os():
    rss = _probe(PROBE)
    # 399 MB freed: glibc kept it resident, the trim returned it.
    assert rss["before"] - rss["after"] > 300, rss


@GLIBC
def test_blocks_over_a_fixed_threshold_go_back_when_freed_without_a_trim():
    plain = PROBE.replace("release_host_memory()\n", "")
    mapped = plain.replace("free(malloc(8 << 20))\n", "from agentloop_core.runtime.host_memory import map_large_blocks\n"
                           "assert map_large_blocks(512 << 10)\nfree(malloc(8 << 20))\n")
    assert mapped.count("map_large_blocks(") == 1
    assert "release_host_memory()" not in mapped
    kept, returned = _probe(plain), _probe(mapped)
    assert kept["before"] > 400, kept  # glibc's own threshold rose to 8 MB: 400 MB held
    assert returned["before"] < 100, returned  # mapped blocks: unmapped as they were freed


@pytest.mark.parametrize("size", [0, -1, (32 << 20) + 1])
def test_a_threshold_glibc_refuses_is_an_error_naming_the_range(size):
    from agentloop_core.runtime.host_memory import map_large_blocks

    with pytest.raises(ValueError, match="32 MB"):
        map_large_blocks(size)


def test_it_runs_where_there_is_nothing_to_trim(monkeypatch):
    """Not glibc (macOS, musl): the call only collects garbage, it does not raise."""
    import ctypes

    from agentloop_core.runtime import host_memory

    def no_libc(_name):
        raise OSError("libc.so.6: cannot open shared object file")

    monkeypatch.setattr(ctypes, "CDLL", no_libc)
    host_memory.release_host_memory()
