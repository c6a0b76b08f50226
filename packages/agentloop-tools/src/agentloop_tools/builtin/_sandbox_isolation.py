"""Who the sandboxed code runs as, and whether this host can isolate it as asked.

- :func:`resolve_user` and :class:`UidLease`: as root, the code runs as a configured user or as a
  uid of its own from ``uid_range``, held by one run at a time across processes.
- :func:`check_isolation`: a supervisor started only to enter the namespaces asked for
  (``isolate_network``, ``isolate_files``, ``private_tmp``), so a host that cannot give them
  fails when the tool is made, naming the fix (:func:`refusal`), never with an unisolated run.

Imported by :mod:`agentloop_tools.builtin.sandbox` only; the namespaces themselves are entered
by the supervisor (:mod:`agentloop_tools.builtin._sandbox_rootfs`).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import pwd
import random
import stat
import subprocess
import sys
import tempfile

from agentloop_tools.builtin import _sandbox_supervisor as supervisor
from agentloop_tools.builtin._sandbox_io import read_status, remove_tree, write_text

__all__ = ["UidLease", "check_isolation", "refusal", "resolve_user"]


def resolve_user(user: str | int) -> tuple[int, int]:
    """The uid and gid of the configured sandbox ``user`` (a name or a uid)."""
    try:
        entry = pwd.getpwuid(user) if isinstance(user, int) else pwd.getpwnam(user)
    except KeyError:
        raise ValueError(f"sandbox user {user!r} does not exist; create it, or leave user unset to get a "
                         "dedicated uid per run") from None
    return entry.pw_uid, entry.pw_gid


class UidLease:
    """A uid from ``uid_range`` held by this run alone: an exclusive ``flock`` on a file named
    after it, in a root-only folder, taken by every sandbox on the host (across processes)."""

    def __init__(self, first: int, last: int) -> None:
        folder = os.path.join(tempfile.gettempdir(), "agentloop-sandbox-uids")
        with contextlib.suppress(FileExistsError):
            os.mkdir(folder, 0o700)
        st = os.lstat(folder)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
            raise RuntimeError(f"sandbox uid lock folder {folder} is not a folder owned by uid {os.geteuid()} "
                               "with mode 0700 (someone else made it); remove it and retry")
        uids = list(range(first, last + 1))
        start = random.randrange(len(uids))
        for uid in uids[start:] + uids[:start]:
            fd = os.open(os.path.join(folder, str(uid)), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            self.uid, self._fd = uid, fd
            return
        raise RuntimeError(f"sandbox: all {len(uids)} uids of uid_range {first}-{last} are in use by running "
                           "sandboxes; widen uid_range or run fewer sandboxes at once")

    def release(self) -> None:
        os.close(self._fd)


def refusal(refused: list[str]) -> str:
    """Why a run was not started: the isolation the host ``refused``, and each fix."""
    return (
        "sandbox: this host does not let the sandbox isolate the code's " + "; ".join(refused) + ". Unisolated, "
        "model-written code can reach every service on this machine's loopback (engine servers, gateways, "
        "databases) and read every file readable by others (the run's data with its answers), so it was not run. "
        "Fix: allow unprivileged user namespaces (sysctl kernel.unprivileged_userns_clone=1 and "
        "user.max_user_namespaces > 0; kernel.apparmor_restrict_unprivileged_userns=0 on Ubuntu 24.04+; in a "
        "container, a seccomp profile that permits unshare), or run the trainer as root with CAP_SYS_ADMIN; or, "
        "for code you trust, opt out in the tool's config with isolate_network: false / isolate_files: false"
    )


_probed: dict[tuple[bool, bool, bool], list[str]] = {}


def check_isolation(*, isolate_network: bool, isolate_files: bool, private_tmp: bool) -> None:
    """Start a supervisor that only enters the namespaces asked for, so that a host
    that cannot give them fails when the tool is made, not at the first rollout. Cached.

    Raises:
        RuntimeError: The isolation cannot be had here, naming the fix.
    """
    key = (isolate_network, isolate_files, private_tmp)
    if not (isolate_network or isolate_files):
        return
    if key not in _probed:
        scratch = tempfile.mkdtemp(prefix="agentloop-sandbox-probe-")
        status_r, status_w = os.pipe()
        try:
            write_text(os.path.join(scratch, "main.py"), "")
            cfg = {"name": os.path.basename(scratch), "scratch": scratch, "uid": None, "gid": None,
                   "dedicated_uid": False, "private_tmp": private_tmp, "scratch_mb": 1,
                   "isolate_network": isolate_network, "isolate_files": isolate_files,
                   "view": {"binds": [], "links": []}, "keep_visible": [], "probe": True, "status_fd": status_w}
            proc = subprocess.run([sys.executable, "-I", "-S", supervisor.__file__, json.dumps(cfg)],
                                  stdin=subprocess.DEVNULL, capture_output=True, timeout=60, pass_fds=(status_w,),
                                  env={"LC_ALL": "C.UTF-8", "PATH": "/usr/bin:/bin"})
            os.close(status_w)
            status_w = -1
            status = read_status(status_r)
            if status is None:
                raise RuntimeError(f"sandbox: the isolation probe exited with {proc.returncode}: "
                                   f"{proc.stderr.decode(errors='replace')[-2000:]}")
            _probed[key] = list(status.get("refused") or [])
        finally:
            for fd in (status_r, status_w):
                if fd >= 0:
                    os.close(fd)
            remove_tree(scratch)
    if _probed[key]:
        raise RuntimeError(refusal(_probed[key]))
