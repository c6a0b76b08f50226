"""The trainer's side of one sandbox run: its output pipes, its status pipe, its files, and the
cleanup when its supervisor died before reporting.

Imported by :mod:`agentloop_tools.builtin.sandbox` and
:mod:`agentloop_tools.builtin._sandbox_isolation` (the supervisor, which runs with ``-I -S``,
loads none of this).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import time
from typing import Any

from agentloop_tools.builtin import _sandbox_cgroup as cgroups
from agentloop_tools.builtin import _sandbox_supervisor as supervisor

__all__ = ["Capture", "read_status", "remove_tree", "sweep", "wait_exit", "write_text"]


class Capture:
    """What was read of one pipe so far, keeping ``limit`` characters from the head (stdout:
    the first results) or the tail (stderr: a traceback ends with the error)."""

    def __init__(self, limit: int, keep: str) -> None:
        self.limit, self.keep = limit, keep
        self.budget = limit * 4  # bytes; decoded and cut to characters in text()
        self.kept = bytearray()
        self.total = 0

    async def drain(self, stream: asyncio.StreamReader) -> None:
        while chunk := await stream.read(65536):
            self.total += len(chunk)
            if self.keep == "head":
                self.kept += chunk[: max(self.budget - len(self.kept), 0)]
            else:
                self.kept = (self.kept + chunk)[-self.budget:]

    def text(self) -> tuple[str, bool]:
        text = self.kept.decode("utf-8", errors="replace")
        if not (self.total > len(self.kept) or len(text) > self.limit):
            return text, False
        marker = f"... [output truncated to {self.limit} characters]"
        if self.keep == "head":
            return text[: self.limit] + "\n" + marker, True
        return marker + "\n" + text[-self.limit:], True


async def wait_exit(proc: asyncio.subprocess.Process, timeout: float) -> bool:
    """Wait for the process to exit (not for its pipes to close, as ``proc.wait()`` does)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    # Polled: proc.wait() also waits for the pipes, which a grandchild that inherited them can
    # hold open past the process's exit, and asyncio offers no exit-only signal to await.
    while proc.returncode is None and loop.time() < deadline:  # noqa: ASYNC110 - see above
        await asyncio.sleep(0.02)
    return proc.returncode is not None


def write_text(path: str, text: str) -> None:
    """Write ``text`` to ``path`` as UTF-8 (the run's ``main.py``)."""
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)


def read_status(fd: int) -> dict[str, Any] | None:
    """The supervisor's JSON report from the status pipe; None when it wrote none (it died)."""
    os.set_blocking(fd, False)
    data = b""
    with contextlib.suppress(BlockingIOError, OSError):
        while chunk := os.read(fd, 65536):
            data += chunk
    try:
        return json.loads(data)
    except ValueError:
        return None


def remove_tree(path: str) -> None:
    """Remove a scratch folder the code may have locked down (``chmod 0``) for its owner."""
    if os.geteuid() != 0:  # root ignores permissions; chmod as root could follow a planted symlink
        for root, dirs, _ in os.walk(path):
            for d in dirs:
                full = os.path.join(root, d)
                if not os.path.islink(full):
                    with contextlib.suppress(OSError):
                        os.chmod(full, 0o700)
    shutil.rmtree(path, ignore_errors=True)


def sweep(marker: str, uid: int | None, cgroup_name: str, cgroup_parent: str | None) -> None:
    """The trainer's fallback when the supervisor died before reporting: kill what carries the
    run's environment marker (or its dedicated uid) or sits in its cgroups, remove its files
    outside the scratch and its cgroups."""
    for _ in range(5):
        pids = set(cgroups.remove_named(cgroup_name, cgroup_parent))
        pids.update(supervisor.pids_with_env(marker.encode()))
        if uid is not None:
            pids.update(supervisor.pids_of_uid(uid))
        if not supervisor.kill_pids(pids):
            break
        time.sleep(0.05)
    if uid is not None:
        supervisor.remove_entries(supervisor.owned_entries(uid))
    cgroups.remove_dirs(cgroup_name, cgroup_parent)
