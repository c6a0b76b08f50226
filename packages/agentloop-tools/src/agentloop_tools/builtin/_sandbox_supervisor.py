"""The sandbox supervisor: a small process between the trainer and the sandboxed code that owns
every process the code starts and enforces the limits whatever the code does.

Run as ``python -I -S _sandbox_supervisor.py CONFIG_JSON`` by
:func:`agentloop_tools.builtin.sandbox.run_python` (standard library only, so it starts fast and
needs nothing the code could tamper with). It keeps the trainer's uid; the code it starts runs
as ``uid``/``gid`` when those are set, so the code cannot signal or trace it. It:

1. makes itself a child subreaper (``PR_SET_CHILD_SUBREAPER``): a process that daemonizes
   (double fork, ``setsid``) is re-parented here, not to init, so it stays findable;
2. enters a network namespace and a mount namespace (as a normal user inside a user namespace
   of its own) and lays out the code's own root folder on a size-limited tmpfs (freed by the
   kernel when the last process of the run is gone), see ``_sandbox_rootfs``; where the kernel
   refuses an isolation that was asked for, it reports that and starts nothing. Without
   ``isolate_files``, the tmpfs goes behind ``/tmp``, ``/dev/shm`` and ``/var/tmp`` instead. It
   puts the code in a cgroup v2 of its own (ends with ``cgroup.kill``) where it may;
3. starts the code (new session, rlimits, ``no_new_privs``, uid drop), waits for it to exit, for
   the wall-clock limit, for the scratch limit (polled where there is no tmpfs) or for SIGTERM
   from the trainer (a cancelled call);
4. kills everything that is left: ``cgroup.kill``; ``kill(-1)`` as a run's dedicated uid;
   SIGKILL to every descendant in ``/proc``; then reaps until it has no child at all, which
   with the subreaper flag means no process of the run exists any more;
5. writes one JSON status line to ``status_fd`` and exits.

The helpers below are imported by the trainer side too, for its fallback sweep.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import shutil
import signal
import stat
import sys
import time
from collections.abc import Iterable
from types import ModuleType

PR_SET_CHILD_SUBREAPER = 36
PR_SET_NO_NEW_PRIVS = 38
CLONE_NEWUSER = 0x10000000

SHARED_TMP_DIRS = ("/tmp", "/dev/shm", "/var/tmp")
"""World-writable folders whose entries outlive a process; private (tmpfs) or swept per run."""

_POLL_S = 0.1  # how often the wall clock and the scratch size are checked


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def set_subreaper() -> bool:
    """Make this process the reaper of its orphaned descendants. Returns False where the
    kernel refuses (before Linux 3.4)."""
    return _libc().prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0


# ---- finding and killing processes -------------------------------------------------------------


def _stat_fields(pid: int | str) -> list[str] | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    return data.rsplit(b")", 1)[1].decode().split()


def descendants(root: int) -> list[int]:
    """Every process below ``root`` in the parent tree, from ``/proc``."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            fields = _stat_fields(entry)
            if fields is not None:
                children.setdefault(int(fields[1]), []).append(int(entry))
    out: list[int] = []
    stack = [root]
    while stack:
        for child in children.get(stack.pop(), []):
            out.append(child)
            stack.append(child)
    return out


def pids_of_uid(uid: int) -> list[int]:
    """Live processes whose real uid is ``uid``."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/status", "rb") as f:
                for line in f:
                    if line.startswith(b"Uid:"):
                        if int(line.split()[1]) == uid:
                            out.append(int(entry))
                        break
        except (OSError, ValueError):
            continue
    return out


def pids_with_env(marker: bytes) -> list[int]:
    """Live processes whose initial environment holds ``marker`` (``NAME=value``)."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/environ", "rb") as f:
                    if marker in f.read().split(b"\0"):
                        out.append(int(entry))
            except OSError:
                continue
    return out


def kill_pids(pids: Iterable[int]) -> int:
    """SIGKILL each pid that still exists; returns how many were signalled."""
    n = 0
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
            n += 1
    return n


def kill_uid(uid: int, gid: int) -> None:
    """``kill(-1, SIGKILL)`` from a child running as ``uid``: the kernel signals every process
    of that uid in one pass under its task-list lock, so none can fork its way out. Only for a
    uid that this run owns alone (never a shared one such as ``nobody``)."""
    pid = os.fork()
    if pid == 0:
        try:
            os.setgroups([])
            os.setresgid(gid, gid, gid)
            os.setresuid(uid, uid, uid)
            os.kill(-1, signal.SIGKILL)
        finally:
            os._exit(0)
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, 0)


# ---- cgroups and the file view (in the files next to this one, loaded without the package when --
# ---- run as a script) ---------------------------------------------------------------------------


def _load_sibling(name: str) -> ModuleType:
    if __package__:
        import importlib

        return importlib.import_module(f"{__package__}.{name}")
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                                     f"{name}.py"))
    assert spec is not None, "the file sits next to this one"
    assert spec.loader is not None, "a source file has a loader"
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


cgroups = _load_sibling("_sandbox_cgroup")
rootfs = _load_sibling("_sandbox_rootfs")
RunCgroups = cgroups.RunCgroups


# ---- scratch space -----------------------------------------------------------------------------


def enter_user_namespace() -> str | None:
    """As a normal user, enter a new user namespace that maps our uid and gid to themselves, so
    that the mount and network namespaces below may be made. The code started later keeps its
    uid and gets no capabilities (they are dropped at ``execve`` for a non-zero uid). Returns
    None, or why the kernel or a security module refused (nothing is changed then)."""
    uid, gid = os.getuid(), os.getgid()
    if _libc().unshare(CLONE_NEWUSER) != 0:
        return (f"unshare(CLONE_NEWUSER) failed: {os.strerror(ctypes.get_errno())} (unprivileged user namespaces "
                "are off: sysctl kernel.unprivileged_userns_clone / user.max_user_namespaces, or "
                "kernel.apparmor_restrict_unprivileged_userns on Ubuntu 24.04+, or a container's seccomp profile)")
    for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
        with open(f"/proc/self/{name}", "w") as f:
            f.write(text)
    return None


def _private_mounts(libc: ctypes.CDLL) -> str | None:
    """A mount namespace of this process's own whose mounts do not propagate back to the host's.
    Returns None, or why the kernel refused (no CAP_SYS_ADMIN)."""
    if libc.unshare(rootfs.CLONE_NEWNS) != 0:
        return f"unshare(CLONE_NEWNS) failed: {os.strerror(ctypes.get_errno())}"
    # Without private propagation the mounts below would appear in the trainer's namespace.
    if libc.mount(b"none", b"/", None, rootfs.MS_REC | rootfs.MS_PRIVATE, None) != 0:
        raise OSError(ctypes.get_errno(), "making / private in the sandbox mount namespace failed")
    return None


def _mount_scratch_tmpfs(libc: ctypes.CDLL, scratch: str, size_mb: int) -> None:
    opts = f"size={size_mb}m,nr_inodes={max(1024, size_mb * 256)},mode=0755".encode()
    if libc.mount(b"agentloop-sandbox", scratch.encode(), b"tmpfs", rootfs.MS_NOSUID | rootfs.MS_NODEV, opts) != 0:
        raise OSError(ctypes.get_errno(), f"mounting the sandbox tmpfs on {scratch} failed")


def private_tmp(scratch: str, size_mb: int, name: str, uid: int | None, gid: int | None,
                keep: Iterable[str] = ()) -> str | None:
    """Enter a new mount namespace and put one tmpfs of ``size_mb`` behind /tmp, /dev/shm and
    /var/tmp, then bind each path of ``keep`` (the interpreter's folders that lie under them)
    back at its place, read-only. Returns the working directory inside it (``/tmp/<name>``),
    or None when the kernel refuses (no CAP_SYS_ADMIN); nothing is changed then."""
    libc = _libc()
    if _private_mounts(libc) is not None:
        return None
    # Opened in this namespace (a bind's source must be one of its mounts) before the masks hide them.
    kept = [(path, os.open(path, os.O_PATH | os.O_CLOEXEC)) for path in keep]
    _mount_scratch_tmpfs(libc, scratch, size_mb)
    # /tmp last: the scratch mount point itself may be under it.
    for target in sorted((d for d in SHARED_TMP_DIRS if os.path.isdir(d)), key=lambda d: d == "/tmp"):
        source = os.path.join(scratch, target.strip("/").replace("/", "-"))
        os.mkdir(source)
        os.chmod(source, 0o1777)
        if libc.mount(source.encode(), target.encode(), None, rootfs.MS_BIND, None) != 0:
            raise OSError(ctypes.get_errno(), f"binding the sandbox tmpfs over {target} failed")
    for path, fd in kept:
        rootfs.bind_read_only(libc, fd, path)
        os.close(fd)
    workdir = os.path.join("/tmp", name)
    os.mkdir(workdir, 0o700)
    if uid is not None and gid is not None:  # set together
        os.chown(workdir, uid, gid)
    return workdir


def owned_entries(uid: int, dirs: Iterable[str] = SHARED_TMP_DIRS) -> list[str]:
    """Top-level entries of ``dirs`` owned by ``uid``."""
    out = []
    for d in dirs:
        with contextlib.suppress(OSError), os.scandir(d) as it:
            for entry in it:
                with contextlib.suppress(OSError):
                    if entry.stat(follow_symlinks=False).st_uid == uid:
                        out.append(entry.path)
    return out


def usage_bytes(paths: Iterable[str]) -> int:
    """Bytes allocated under ``paths`` (symlinks not followed)."""
    total = 0
    for top in paths:
        stack = [top]
        while stack:
            path = stack.pop()
            try:
                st = os.lstat(path)
            except OSError:
                continue
            total += st.st_blocks * 512
            if stat.S_ISDIR(st.st_mode):
                with contextlib.suppress(OSError):
                    stack.extend(os.path.join(path, n) for n in os.listdir(path))
    return total


def remove_entries(paths: Iterable[str]) -> None:
    for path in paths:
        with contextlib.suppress(OSError):
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path, ignore_errors=True)
            else:
                os.unlink(path)


# ---- the run -----------------------------------------------------------------------------------


def _start(cfg: dict, workdir: str, env: dict[str, str], run_cgroups: RunCgroups, root: str | None) -> int:
    import resource

    uid, gid = cfg["uid"], cfg["gid"]
    limits = [(resource.RLIMIT_AS, cfg["memory_bytes"]), (resource.RLIMIT_CPU, cfg["cpu_s"]),
              (resource.RLIMIT_FSIZE, cfg["file_bytes"]), (resource.RLIMIT_NOFILE, cfg["max_open_files"]),
              (resource.RLIMIT_CORE, 0), (resource.RLIMIT_NPROC, cfg["max_processes"])]
    pid = os.fork()
    if pid:
        return pid
    try:  # the child: only syscalls from here to exec
        signal.pthread_sigmask(signal.SIG_SETMASK, [])
        os.close(cfg["status_fd"])
        run_cgroups.join()
        os.setsid()
        if root is not None:
            rootfs.enter_root(root)
        os.chdir(workdir)
        for which, value in limits:
            resource.setrlimit(which, (value, value))
        _libc().prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)  # setuid binaries cannot give privileges back
        if uid is not None:
            os.setgroups([])
            os.setresgid(gid, gid, gid)
            os.setresuid(uid, uid, uid)
        os.execve(cfg["python"], [cfg["python"], *cfg["python_args"], os.path.join(workdir, "main.py")], env)
    except BaseException as exc:  # noqa: BLE001 - reported on the code's stderr, then exit 127
        with contextlib.suppress(OSError):
            os.write(2, f"sandbox: could not start {cfg['python']}: {type(exc).__name__}: {exc}\n".encode())
    os._exit(127)


def _reap(main: int, status: list[int | None]) -> bool:
    """Reap every exited child; returns False once there are no children left."""
    while True:
        try:
            pid, wstatus = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return False
        if pid == 0:
            return True
        if pid == main:
            status[0] = os.waitstatus_to_exitcode(wstatus)


def _kill_everything(cfg: dict, run_cgroups: RunCgroups, main: int, status: list[int | None]) -> int:
    me, rounds = os.getpid(), 0
    while True:
        rounds += 1
        run_cgroups.kill()
        if cfg["dedicated_uid"]:
            kill_uid(cfg["uid"], cfg["gid"])
        kill_pids(descendants(me))
        kill_pids(run_cgroups.members())
        if not _reap(main, status):
            return rounds
        time.sleep(0.01)


def _isolate(cfg: dict) -> tuple[str, str | None, list[str], list[str], list[str]]:
    """Enter the namespaces ``cfg`` asks for and lay out the code's files. Returns the working
    directory (as the supervisor sees it), the root folder the code enters (None: the host's),
    the folders whose size is polled, the isolation labels, and what could not be isolated and
    why (the run must not start then)."""
    uid, gid, scratch = cfg["uid"], cfg["gid"], cfg["scratch"]
    isolation: list[str] = []
    refused: list[str] = []
    no_ns = None
    if os.geteuid() != 0 and (cfg["private_tmp"] or cfg["isolate_files"] or cfg["isolate_network"]):
        no_ns = enter_user_namespace()
    if cfg["isolate_network"]:
        why = no_ns or rootfs.enter_network_namespace()
        if why:
            refused.append(f"network ({why})")
        else:
            isolation.append("isolated-network")
    libc = _libc()
    if cfg["isolate_files"]:
        why = no_ns or _private_mounts(libc)
        if why:
            refused.append(f"files ({why})")
            return scratch, None, [], isolation, refused
        if cfg["private_tmp"]:
            _mount_scratch_tmpfs(libc, scratch, cfg["scratch_mb"])
            isolation.append("private-tmpfs")
        root, workdir = rootfs.build_root(scratch, cfg["name"], uid, gid, cfg["view"]["binds"], cfg["view"]["links"])
        isolation.append("isolated-files")
        watch = [] if cfg["private_tmp"] else [os.path.join(scratch, "files")]
        return workdir, root, watch, isolation, refused
    if cfg["private_tmp"] and no_ns is None:
        inner = private_tmp(scratch, cfg["scratch_mb"], cfg["name"], uid, gid, cfg["keep_visible"])
        if inner is not None:
            isolation.append("private-tmpfs")
            return inner, None, [], isolation, refused
    return scratch, None, [scratch], isolation, refused


def supervise(cfg: dict) -> dict:
    """Run the code under ``cfg`` (see :func:`agentloop_tools.builtin.sandbox.run_python`) and
    return the status it reports."""
    set_subreaper()
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGCHLD, signal.SIGTERM})
    uid, gid = cfg["uid"], cfg["gid"]
    if cfg["dedicated_uid"]:
        kill_uid(uid, gid)  # leftovers of a trainer that died mid-run with this uid
    with open(os.path.join(cfg["scratch"], "main.py"), encoding="utf-8") as f:
        code = f.read()
    workdir, root, watch, isolation, refused = _isolate(cfg)
    if refused or cfg.get("probe"):
        return {"returncode": None, "reason": "isolation-refused", "isolation": isolation, "refused": refused}
    if root is not None or "private-tmpfs" in isolation:  # a fresh folder, the host's scratch hidden
        path = os.path.join(workdir, "main.py")
        with open(path, "w", encoding="utf-8") as f:
            f.write(code)
        if uid is not None:
            os.chown(path, uid, gid)
    run_cgroups = (cgroups.create(cfg["name"], cfg["run_memory_bytes"], cfg["max_processes"], cfg["cgroup_parent"])
                   if cfg["cgroup"] else RunCgroups(unenforced=["per-run cgroups are off"]))
    isolation += [label for label, on in (("cgroup", run_cgroups.kill_dir), ("cgroup-memory", run_cgroups.memory),
                                          ("cgroup-pids", run_cgroups.pids)) if on]
    inside = workdir if root is None else os.path.join("/tmp", cfg["name"])  # where the code sees it
    env = {**cfg["env"], "HOME": inside, "TMPDIR": inside}
    main = _start(cfg, inside, env, run_cgroups, root)
    status: list[int | None] = [None]
    deadline = time.monotonic() + cfg["timeout_s"]
    reason = None
    while reason is None:
        _reap(main, status)
        if status[0] is not None:
            break
        now = time.monotonic()
        if now >= deadline:
            reason = "timeout"
            break
        if watch:
            shared = owned_entries(uid) if cfg["dedicated_uid"] and uid is not None and root is None else []
            if usage_bytes(watch + shared) > cfg["scratch_mb"] * 2**20:
                reason = "scratch"
                break
        info = signal.sigtimedwait({signal.SIGCHLD, signal.SIGTERM}, min(_POLL_S, max(deadline - now, 0.001)))
        if info is not None and info.si_signo == signal.SIGTERM:
            reason = "cancelled"
    rounds = _kill_everything(cfg, run_cgroups, main, status)
    usage = {"memory_peak_bytes": run_cgroups.memory_peak_bytes(), "oom_kills": run_cgroups.oom_kills(),
             "pids_refused": run_cgroups.pids_refused(), "unenforced": run_cgroups.unenforced}
    run_cgroups.remove()
    if cfg["dedicated_uid"] and uid is not None and "private-tmpfs" not in isolation and root is None:
        remove_entries(owned_entries(uid))
    return {"returncode": status[0], "reason": reason, "isolation": isolation, "kill_rounds": rounds, **usage}


def main() -> None:
    cfg = json.loads(sys.argv[1])
    result = supervise(cfg)
    os.write(cfg["status_fd"], (json.dumps(result) + "\n").encode())
    os._exit(0)


if __name__ == "__main__":
    main()
