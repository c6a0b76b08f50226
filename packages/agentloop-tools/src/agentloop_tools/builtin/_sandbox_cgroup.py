"""Per-run cgroups of the sandbox: one to kill the run in one step, and the limits that hold for
all of a run's processes together (memory, process count).

Standard library only: the supervisor loads this file next to itself (it runs with ``-I -S``).

Where each piece comes from, tried in order:

- **cgroup v2** (``<parent>/<run>``, the parent being the supervisor's own cgroup or the
  configured ``cgroup_parent``): ``cgroup.kill``; ``memory.max`` with ``memory.swap.max = 0``
  and ``pids.max`` where the parent's ``cgroup.subtree_control`` has (or can be given) the
  ``memory`` and ``pids`` controllers. The kernel only lets a cgroup hand controllers to its
  children when it has no processes of its own, the root cgroup excepted, so a trainer inside a
  non-root cgroup needs a delegated, empty ``cgroup_parent`` for the limits.
- **cgroup v1** (a hybrid host, where ``memory`` or ``pids`` are still bound to v1 hierarchies):
  ``memory.limit_in_bytes`` (and ``memory.memsw.limit_in_bytes``, so swap adds nothing) and
  ``pids.max`` in a cgroup of the run below the supervisor's own in each hierarchy.
- Otherwise the limit is not enforced per run, and :attr:`RunCgroups.unenforced` says why.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def _write(path: str, text: str) -> bool:
    try:
        with open(path, "w") as f:
            f.write(text)
    except OSError:
        return False
    return True


def _mounts() -> list[tuple[str, str, list[str]]]:
    """(mount point, filesystem type, super options) of every mount."""
    out = []
    for line in (_read("/proc/self/mountinfo") or "").splitlines():
        parts = line.split()
        if "-" in parts:
            i = parts.index("-")
            out.append((parts[4], parts[i + 1], parts[i + 3].split(",") if len(parts) > i + 3 else []))
    return out


def _own_cgroups() -> list[tuple[str, list[str], str]]:
    """(hierarchy id, controllers, path) of each line of ``/proc/self/cgroup``."""
    out = []
    for line in (_read("/proc/self/cgroup") or "").splitlines():
        parts = line.strip().split(":", 2)
        if len(parts) == 3:
            out.append((parts[0], parts[1].split(",") if parts[1] else [], parts[2]))
    return out


def cgroup2_root() -> str | None:
    """Our own cgroup's folder in the cgroup v2 hierarchy, if one is mounted."""
    mount = next((m for m, fstype, _ in _mounts() if fstype == "cgroup2"), None)
    rel = next((path for hid, _, path in _own_cgroups() if hid == "0"), None)
    if mount is None or rel is None:
        return None
    return os.path.join(mount, rel.lstrip("/"))


def cgroup1_dir(controller: str) -> str | None:
    """Our own cgroup's folder in the cgroup v1 hierarchy that holds ``controller``, if any."""
    mount = next((m for m, fstype, opts in _mounts() if fstype == "cgroup" and controller in opts), None)
    rel = next((path for _, ctrls, path in _own_cgroups() if controller in ctrls), None)
    if mount is None or rel is None:
        return None
    return os.path.join(mount, rel.lstrip("/"))


def cgroup_kill(path: str) -> None:
    """Kill every process in the cgroup v2 at ``path`` (no-op if it does not exist)."""
    _write(os.path.join(path, "cgroup.kill"), "1")


@dataclass
class RunCgroups:
    """The cgroups made for one run, and which per-run limits they enforce."""

    kill_dir: str | None = None
    """A cgroup v2 with ``cgroup.kill`` holding the run, or None."""
    memory: tuple[str, str] | None = None
    """(``"v1"`` or ``"v2"``, folder) of the cgroup that limits the run's memory, or None."""
    pids: tuple[str, str] | None = None
    """(``"v1"`` or ``"v2"``, folder) of the cgroup that limits the run's process count, or None."""
    created: list[str] = field(default_factory=list)
    """Every folder made, in the order made (removed in reverse)."""
    unenforced: list[str] = field(default_factory=list)
    """For each per-run limit that is not enforced: why, and how to get it."""

    def procs_files(self) -> list[str]:
        """The ``cgroup.procs`` files a process of the run must join (one per hierarchy)."""
        dirs = {d for d in (self.kill_dir, self.memory and self.memory[1], self.pids and self.pids[1]) if d}
        return sorted(os.path.join(d, "cgroup.procs") for d in dirs)

    def join(self) -> None:
        """Move the calling process into every cgroup of the run (raises OSError if refused)."""
        for path in self.procs_files():
            with open(path, "w") as f:
                f.write("0")

    def kill(self) -> None:
        if self.kill_dir is not None:
            cgroup_kill(self.kill_dir)

    def members(self) -> list[int]:
        """Pids listed in the run's cgroups (v1 hierarchies have no ``cgroup.kill``)."""
        pids: set[int] = set()
        for path in self.procs_files():
            pids.update(int(p) for p in (_read(path) or "").split() if p.isdigit())
        return sorted(pids)

    def memory_peak_bytes(self) -> int | None:
        """Most memory the run held at once, where the kernel reports it (v2 since Linux 5.19)."""
        if self.memory is None:
            return None
        version, folder = self.memory
        names = ("memory.peak",) if version == "v2" else ("memory.memsw.max_usage_in_bytes", "memory.max_usage_in_bytes")
        for name in names:
            text = _read(os.path.join(folder, name))
            if text is not None and text.strip().isdigit():
                return int(text)
        return None

    def oom_kills(self) -> int:
        """How many of the run's processes the kernel killed at the memory limit."""
        if self.memory is None:
            return 0
        version, folder = self.memory
        text = _read(os.path.join(folder, "memory.events" if version == "v2" else "memory.oom_control")) or ""
        return _counter(text, "oom_kill")

    def pids_refused(self) -> int:
        """How many forks the process limit refused."""
        if self.pids is None:
            return 0
        return _counter(_read(os.path.join(self.pids[1], "pids.events")) or "", "max")

    def remove(self) -> None:
        """Remove the run's cgroups (once it has no process left)."""
        for path in reversed(self.created):
            with contextlib.suppress(OSError):
                os.rmdir(path)


def _counter(text: str, key: str) -> int:
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[0] == key and parts[1].isdigit():
            return int(parts[1])
    return 0


def _mkdir(path: str, run: RunCgroups) -> bool:
    try:
        os.mkdir(path)
    except FileExistsError:
        pass
    except OSError:
        return False
    else:
        run.created.append(path)
    return True


def _v2_enable(parent: str, controller: str) -> str | None:
    """Make ``controller`` available to ``parent``'s children; None when it is, else why not."""
    enabled = (_read(os.path.join(parent, "cgroup.subtree_control")) or "").split()
    if controller in enabled:
        return None
    if controller not in (_read(os.path.join(parent, "cgroup.controllers")) or "").split():
        return f"the cgroup v2 {parent} does not have the {controller} controller"
    if _write(os.path.join(parent, "cgroup.subtree_control"), f"+{controller}"):
        return None
    return (f"{controller} cannot be enabled in {parent}/cgroup.subtree_control (a cgroup that holds "
            "processes, as the trainer's own does, cannot hand controllers to its children)")


def _v1_run_dir(controller: str, name: str, run: RunCgroups) -> tuple[str | None, str]:
    base = cgroup1_dir(controller)
    if base is None:
        return None, f"no cgroup v1 hierarchy has the {controller} controller"
    path = os.path.join(base, name)
    if not _mkdir(path, run):
        return None, f"cannot create a cgroup under {base} (cgroup v1 {controller})"
    return path, ""


_FIX = ("set cgroup_parent to a delegated cgroup v2 with no processes of its own and memory and pids in its "
        "cgroup.subtree_control (e.g. systemd Delegate=yes), or run the trainer in a container that limits it")


def create(name: str, memory_bytes: int, max_pids: int, parent: str | None = None) -> RunCgroups:
    """Make the cgroups of run ``name`` with the limits set; never raises (see ``unenforced``).

    Args:
        name: The run's cgroup name (unique per run).
        memory_bytes: Memory all processes of the run may hold together (``memory.max``).
        max_pids: Processes (and threads) the run may have at once (``pids.max``).
        parent: A cgroup v2 folder to create the run's cgroup in; None: our own cgroup.
    """
    run = RunCgroups()
    base = parent or cgroup2_root()
    v2 = os.path.join(base, name) if base is not None else None
    if v2 is not None and _mkdir(v2, run):
        if os.path.exists(os.path.join(v2, "cgroup.kill")):
            run.kill_dir = v2
        else:
            run.remove()
            run.created.clear()
            v2 = None
    else:
        v2 = None
    why: dict[str, str] = {}
    for controller, setting in (("memory", memory_bytes), ("pids", max_pids)):
        if v2 is not None and base is not None:
            reason = _v2_enable(base, controller)
            limit_file = os.path.join(v2, "memory.max" if controller == "memory" else "pids.max")
            if reason is None and _write(limit_file, str(setting)):
                if controller == "memory":
                    if os.path.exists(os.path.join(v2, "memory.swap.max")):
                        _write(os.path.join(v2, "memory.swap.max"), "0")
                    run.memory = ("v2", v2)
                else:
                    run.pids = ("v2", v2)
                continue
            why[controller] = reason or f"writing {limit_file} failed"
        elif base is None:
            why[controller] = "no cgroup v2 is mounted"
        else:
            why[controller] = f"cannot create a cgroup v2 under {base}"
        if parent is not None:
            continue  # a configured parent is the only place meant
        path, reason = _v1_run_dir(controller, name, run)
        if path is None:
            why[controller] += f"; {reason}"
            continue
        if controller == "memory":
            ok = _write(os.path.join(path, "memory.limit_in_bytes"), str(setting))
            memsw = os.path.join(path, "memory.memsw.limit_in_bytes")
            if ok and os.path.exists(memsw):  # after limit_in_bytes: memsw may never be below it
                ok = _write(memsw, str(setting))
            if ok:
                run.memory = ("v1", path)
                del why[controller]
                continue
        elif _write(os.path.join(path, "pids.max"), str(setting)):
            run.pids = ("v1", path)
            del why[controller]
            continue
        why[controller] += f"; setting the limit in the cgroup v1 {path} failed"
    for controller, reason in why.items():
        key = "run_memory_mb" if controller == "memory" else "max_processes"
        run.unenforced.append(f"{key} is not enforced per run ({reason}); {_FIX}")
    return run


def remove_named(name: str, parent: str | None = None) -> list[int]:
    """The trainer's fallback when a supervisor died: kill what is left in run ``name``'s
    cgroups and remove them. Returns the pids found in its cgroup v1 hierarchies."""
    base = parent or cgroup2_root()
    v2 = os.path.join(base, name) if base is not None else None
    found: list[int] = []
    if v2 is not None:
        cgroup_kill(v2)
    v1 = [os.path.join(d, name) for d in (cgroup1_dir("memory"), cgroup1_dir("pids")) if d is not None]
    for folder in v1:
        found.extend(int(p) for p in (_read(os.path.join(folder, "cgroup.procs")) or "").split() if p.isdigit())
    return found


def remove_dirs(name: str, parent: str | None = None) -> None:
    """Remove run ``name``'s cgroup folders wherever they were made (no-op where absent)."""
    base = parent or cgroup2_root()
    dirs = [os.path.join(d, name) for d in (base, cgroup1_dir("memory"), cgroup1_dir("pids")) if d is not None]
    for folder in dirs:
        with contextlib.suppress(OSError):
            os.rmdir(folder)
