"""What the sandboxed code can reach: a network namespace of its own and a file view of its own.

Loaded by the supervisor (standard library only, by file path when it runs as a script). Both
need a namespace the kernel lets this process create: as root directly, as a normal user inside
the user namespace the supervisor enters first. Where the kernel refuses, the supervisor does
not run the code unisolated: it reports why, and the trainer raises (``isolate_network: false``
/ ``isolate_files: false`` are the documented opt-outs).

- :func:`enter_network_namespace`: a new network namespace with only a loopback of its own, so
  the code reaches no service of the host (an engine server or gateway on 127.0.0.1, a database,
  a dashboard, abstract unix sockets) and nothing outside (no DNS, no egress).
- :func:`build_root` and :func:`enter_root`: a root folder holding the system's programs and
  libraries (``/usr``, ``/lib*``, ``/bin``, ``/sbin``) and the interpreter's own folders, all
  read-only, a few device nodes, and fresh ``/tmp``, ``/var/tmp`` and ``/dev/shm`` with the
  run's working directory in ``/tmp``. No ``/home``, ``/root``, ``/etc``, ``/proc``, no data or
  checkpoint folder of the run: files that are readable by others on the host (a dataset with
  its ground-truth answers) are simply not there. The code's process enters it with
  ``pivot_root`` in a mount namespace of its own, and the old root is detached, so there is
  nothing beneath to climb back to.
"""

from __future__ import annotations

import ctypes
import fcntl
import os
import platform
import socket
import stat
import struct

CLONE_NEWNS = 0x00020000
CLONE_NEWNET = 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 0x1, 0x2, 0x4, 0x8, 0x20
MS_NOATIME, MS_NODIRATIME, MS_BIND, MS_REC, MS_PRIVATE, MS_RELATIME = 0x400, 0x800, 0x1000, 0x4000, 0x40000, 0x200000
MNT_DETACH = 2
# statvfs f_flag bits (ST_*) -> the mount flags a read-only remount must repeat: a mount copied
# into a user namespace has them locked, and a remount that drops one is refused.
_ST_TO_MS = ((os.ST_NOSUID, MS_NOSUID), (os.ST_NODEV, MS_NODEV), (os.ST_NOEXEC, MS_NOEXEC),
             (os.ST_NOATIME, MS_NOATIME), (os.ST_NODIRATIME, MS_NODIRATIME), (os.ST_RELATIME, MS_RELATIME))
# glibc has no pivot_root wrapper; where the number is unknown, chroot (the code has no
# CAP_SYS_CHROOT to leave it unless it runs as root).
_SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "riscv64": 41, "ppc64le": 203, "s390x": 217}.get(platform.machine())

SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
"""Folders of the system's programs and libraries every view gets, read-only (the interpreter's
shared libraries and the programs ``subprocess`` may run live there)."""

DEVICES = ("/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom")
PRIVATE_DIRS = ("/tmp", "/var/tmp", "/dev/shm")
"""Writable, empty folders of the view, each its own (world-writable, sticky) folder of the scratch."""


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _fail(what: str) -> OSError:
    errno = ctypes.get_errno()
    return OSError(errno, f"{what}: {os.strerror(errno)}")


def enter_network_namespace() -> str | None:
    """Move this process into a new network namespace and bring its loopback up (the code can
    still talk to its own processes over 127.0.0.1). Returns None, or why the kernel refused."""
    if _libc().unshare(CLONE_NEWNET) != 0:
        return f"unshare(CLONE_NEWNET) failed: {os.strerror(ctypes.get_errno())}"
    siocgifflags, siocsifflags, iff_up = 0x8913, 0x8914, 0x1
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            req = struct.pack("16sh22x", b"lo", 0)
            flags = struct.unpack("16sh22x", fcntl.ioctl(s, siocgifflags, req))[1]
            fcntl.ioctl(s, siocsifflags, struct.pack("16sh22x", b"lo", flags | iff_up))
    except OSError:
        pass  # isolated all the same; only loopback within the run is missing
    return None


def bind_read_only(libc: ctypes.CDLL, source: str | int, target: str) -> None:
    """Bind ``source`` (a path, or an ``O_PATH`` descriptor) onto ``target``, read-only, making
    the mount point (a folder, or an empty file) and its parents first."""
    st = os.fstat(source) if isinstance(source, int) else os.stat(source)
    is_dir = stat.S_ISDIR(st.st_mode)
    os.makedirs(target if is_dir else os.path.dirname(target), mode=0o755, exist_ok=True)
    if not is_dir and not os.path.exists(target):
        os.close(os.open(target, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o644))
    src = f"/proc/self/fd/{source}" if isinstance(source, int) else source
    if libc.mount(src.encode(), target.encode(), None, MS_BIND | MS_REC, None) != 0:
        raise _fail(f"binding {src} onto {target} in the sandbox failed")
    locked = os.statvfs(target).f_flag
    flags = MS_REMOUNT | MS_BIND | MS_RDONLY
    for st_flag, ms_flag in _ST_TO_MS:
        if locked & st_flag:
            flags |= ms_flag
    if libc.mount(None, target.encode(), None, flags, None) != 0:
        raise _fail(f"making {target} read-only in the sandbox failed")


def _under_private(path: str) -> bool:
    return any(path == d or path.startswith(d + "/") for d in PRIVATE_DIRS)


def _make_links(root: str, links: list[list[str]]) -> None:
    for path, target in sorted(links, key=lambda link: len(link[0])):
        os.makedirs(root + os.path.dirname(path), mode=0o755, exist_ok=True)
        os.symlink(target, root + path)


def build_root(scratch: str, name: str, uid: int | None, gid: int | None, binds: list[str],
               links: list[list[str]]) -> tuple[str, str]:
    """Lay out the code's root folder under ``scratch`` (in this process's mount namespace,
    which must be private already) and return ``(root, workdir)``: the folder to enter, and the
    working directory as the supervisor sees it (``/tmp/<name>`` once entered).

    ``scratch/files`` holds every writable folder of the view (the tmpfs of the run, or a folder
    whose size is polled); ``scratch/root`` is the view itself, read-only but for those.
    ``binds`` are host folders or files shown at the same path, read-only; ``links`` are
    ``[path, target]`` symlinks to recreate (``/lib -> usr/lib``).
    """
    libc = _libc()
    root, files = os.path.join(scratch, "root"), os.path.join(scratch, "files")
    os.mkdir(root, 0o755)
    os.mkdir(files, 0o755)
    later: list[str] = []  # binds (and links) below a private folder: made once that folder is mounted
    late_links = [link for link in links if _under_private(link[0])]
    _make_links(root, [link for link in links if not _under_private(link[0])])
    for path in binds:
        if _under_private(path):
            later.append(path)
        elif os.path.isdir(path):
            os.makedirs(root + path, mode=0o755, exist_ok=True)
        else:
            os.makedirs(root + os.path.dirname(path), mode=0o755, exist_ok=True)
            os.close(os.open(root + path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o644))
    for path in (*PRIVATE_DIRS, *DEVICES):
        if path in PRIVATE_DIRS:
            os.makedirs(root + path, mode=0o755, exist_ok=True)
        else:
            os.makedirs(root + os.path.dirname(path), mode=0o755, exist_ok=True)
            os.close(os.open(root + path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o644))
    # The view's own folders are read-only: writes go to the private folders or fail.
    if libc.mount(root.encode(), root.encode(), None, MS_BIND | MS_REC, None) != 0:
        raise _fail("binding the sandbox root onto itself failed")
    if libc.mount(None, root.encode(), None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV, None) != 0:
        raise _fail("making the sandbox root read-only failed")
    for path in binds:
        if path not in later:
            bind_read_only(libc, path, root + path)
    for path in PRIVATE_DIRS:
        source = os.path.join(files, path.strip("/").replace("/", "-"))
        os.mkdir(source)
        os.chmod(source, 0o1777)
        if libc.mount(source.encode(), (root + path).encode(), None, MS_BIND, None) != 0:
            raise _fail(f"binding the sandbox's private {path} failed")
        if libc.mount(None, (root + path).encode(), None, MS_REMOUNT | MS_BIND | MS_NOSUID | MS_NODEV, None) != 0:
            raise _fail(f"making the sandbox's private {path} nosuid failed")
    for path in DEVICES:
        if os.path.exists(path) and libc.mount(path.encode(), (root + path).encode(), None, MS_BIND, None) != 0:
            raise _fail(f"binding {path} into the sandbox failed")
    _make_links(root, late_links)
    for path in later:
        bind_read_only(libc, path, root + path)
    workdir = os.path.join(files, "tmp", name)
    os.mkdir(workdir, 0o700)
    if uid is not None and gid is not None:  # set together
        os.chown(workdir, uid, gid)
    return root, workdir


def enter_root(root: str) -> None:
    """In the code's process (before ``execve``): a mount namespace of its own, ``root`` as its
    root folder, the old root detached. The supervisor's own view is left as it was."""
    libc = _libc()
    if libc.unshare(CLONE_NEWNS) != 0:
        raise _fail("unshare(CLONE_NEWNS) for the code failed")
    os.chdir(root)
    if _SYS_PIVOT_ROOT is None:
        os.chroot(".")
    else:
        # pivot_root(".", "."): the old root is stacked on the new one; detaching it leaves nothing
        # of the host's tree in this namespace (see pivot_root(2), NOTES).
        if libc.syscall(_SYS_PIVOT_ROOT, b".", b".") != 0:
            raise _fail("pivot_root into the sandbox root failed")
        if libc.umount2(b".", MNT_DETACH) != 0:
            raise _fail("detaching the host's root from the sandbox failed")
    os.chdir("/")
