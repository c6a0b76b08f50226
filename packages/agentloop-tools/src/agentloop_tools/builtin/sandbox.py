"""A Python code tool that runs model-written code in a limited subprocess.

Every run goes through a supervisor process (:mod:`agentloop_tools.builtin._sandbox_supervisor`)
that owns each process the code starts, so the wall-clock limit holds whatever the code does:
children that call ``setsid()``, double-fork or daemonize are re-parented to the supervisor
(``PR_SET_CHILD_SUBREAPER``) and killed with the run, by ``cgroup.kill`` where a cgroup v2 can
be created, by ``kill(-1)`` as the run's own uid when started as root, and by a walk of
``/proc`` otherwise. The output pipes are read with a deadline, so a process that escaped
anyway cannot hold the call open.

Started as root, the code runs by default as a uid of its own (one per concurrent run, from
``uid_range``), with no supplementary groups and ``no_new_privs``: it cannot read the trainer's
environment through ``/proc``, write where the trainer writes, or signal other runs. As root the
code also gets a private, size-limited tmpfs behind ``/tmp``, ``/dev/shm`` and ``/var/tmp``
(a mount namespace), freed with the run. As a normal user it runs as that user: a minimal
environment, the same private tmpfs where unprivileged user namespaces are allowed (else a
private scratch folder, ``TMPDIR`` and ``HOME`` pointing into it, whose size is polled), and
rlimits.

The code is the policy under optimisation, an adversary that wants the run's answers: by
default it runs in a network namespace of its own (``isolate_network``: no service on the host's
loopback, no egress) and sees only its own folders and, read-only, the system's and the
interpreter's (``isolate_files``: no data folder, ``/home``, ``/etc`` or ``/proc``), see
:mod:`agentloop_tools.builtin._sandbox_rootfs`. A host that cannot make those namespaces gets a
``RuntimeError`` naming the fix, never an unisolated run. The table in the package README says
what is and is not enforced in each case; it is not a boundary against code run as root, nor a
replacement for a container or VM (gVisor, Firecracker, nsjail) for untrusted code at scale.

Who the code runs as and the isolation probe are :mod:`agentloop_tools.builtin._sandbox_isolation`;
reading a run's pipes and cleaning up after it, :mod:`agentloop_tools.builtin._sandbox_io`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from typing import Any

from agentloop_tools.base import BaseTool
from agentloop_tools.builtin import _sandbox_interpreter as interpreter
from agentloop_tools.builtin import _sandbox_rootfs as rootfs
from agentloop_tools.builtin import _sandbox_supervisor as supervisor
from agentloop_tools.builtin._sandbox_io import (
    Capture,
    read_status,
    remove_tree,
    sweep,
    wait_exit,
    write_text,
)
from agentloop_tools.builtin._sandbox_isolation import UidLease, refusal, resolve_user
from agentloop_tools.builtin._sandbox_isolation import check_isolation as probe_isolation
from agentloop_tools.schema import OpenAIFunctionToolSchema, ToolResponse

__all__ = ["PythonSandboxTool", "SandboxLimits", "SandboxResult", "run_python"]

logger = logging.getLogger(__name__)

_GRACE_S = 10.0  # how long past the limit the supervisor may take to kill and report
_PIPE_GRACE_S = 2.0  # how long the pipes may stay open once the supervisor is gone


@dataclass(frozen=True)
class SandboxLimits:
    """Resource limits for one run. Every field is also a key of the tool's YAML ``config:``."""

    timeout_s: float = 10.0
    """Wall-clock seconds before every process of the run is killed."""
    memory_mb: int = 512
    """Address-space limit per process (RLIMIT_AS), in MiB."""
    run_memory_mb: int = 1024
    """Memory (resident, page cache and tmpfs scratch; no swap) all processes of a run may hold
    together, in MiB: ``memory.max`` of the run's cgroup where the host lets the sandbox set one
    (see ``cgroup_parent``); past it the kernel kills processes of the run. Not enforced where
    no cgroup memory controller can be used (:attr:`SandboxResult.unenforced` says so)."""
    max_processes: int = 64
    """Processes (and threads) of a run at once: ``pids.max`` of the run's cgroup where the host
    allows one (also as root), and always RLIMIT_NPROC for the code's uid (per run with the default
    dedicated uids; shared by concurrent runs with ``user=`` set; the kernel exempts root)."""
    max_output_chars: int = 8192
    """Characters kept of stdout (its head) and of stderr (its tail); the rest is dropped with a marker."""
    max_file_mb: int = 16
    """Largest file the code may write (RLIMIT_FSIZE), in MiB."""
    max_scratch_mb: int = 64
    """Total MiB the run may keep in its working directory (and, as root, in /tmp, /dev/shm and
    /var/tmp): a tmpfs of this size as root, a polled size check (the run is killed) otherwise."""
    max_open_files: int = 64
    """RLIMIT_NOFILE."""
    python_executable: str | None = None
    """Interpreter to run. None: this one, or, when the code runs as another uid that cannot reach
    it (e.g. a venv under /root), the first of /usr/bin/python3 and /usr/local/bin/python3 it can."""
    allow_site_packages: bool = False
    """Let the code import installed packages (drops ``-S``)."""
    user: str | int | None = None
    """When started as root: run as this user (name or uid) instead of a dedicated uid per run.
    A shared user weakens the sandbox (concurrent runs share its process limit and files)."""
    uid_range: tuple[int, int] = (61000, 61999)
    """When started as root with no ``user``: the uids (inclusive) handed out, one per concurrent
    run. They must belong to no one else on the host."""
    run_as_root: bool = False
    """When started as root, keep root for the code. Unsafe: it can then read the trainer's
    environment through /proc and write wherever the trainer can. Off by default."""
    private_tmp: bool = True
    """Give the run a private tmpfs of ``max_scratch_mb`` behind /tmp, /dev/shm and /var/tmp (a mount
    namespace; as a normal user inside a user namespace, where the kernel allows one). Folders of
    the interpreter under them (a venv in /tmp) are bound back read-only."""
    isolate_network: bool = True
    """Run the code in a network namespace of its own (a loopback of its own, nothing else): it
    reaches no service of the host (an engine server or gateway on 127.0.0.1, a database, a
    dashboard, abstract unix sockets) and nothing outside (no DNS, no egress). Where the host
    allows no such namespace every run fails with a ``RuntimeError`` naming the fix; ``false``
    gives the code the host's network (only for code you trust)."""
    isolate_files: bool = True
    """Show the code only its working directory (in a fresh ``/tmp``), fresh ``/var/tmp`` and
    ``/dev/shm``, a few devices, and, read-only, the system's programs and libraries (``/usr``,
    ``/lib*``, ``/bin``, ``/sbin``) and the interpreter's folders: no ``/home``, ``/root``,
    ``/etc``, ``/proc``, and none of the run's files, however readable (a dataset with its
    answers). Needs a mount namespace, as for ``private_tmp``; where the host allows none every run
    fails with a ``RuntimeError`` naming the fix. ``false``: the code sees the host's files as its
    uid may."""
    cgroup_parent: str | None = None
    """A cgroup v2 folder to create each run's cgroup in (delegated to the trainer's uid, no
    processes of its own, ``memory`` and ``pids`` in its ``cgroup.subtree_control``). None: the
    supervisor's own cgroup, which can hand out those controllers only as the root cgroup; on a
    hybrid host the cgroup v1 memory and pids hierarchies are used instead."""

    def __post_init__(self) -> None:
        if isinstance(self.uid_range, list):
            object.__setattr__(self, "uid_range", tuple(self.uid_range))
        for name in ("timeout_s", "memory_mb", "run_memory_mb", "max_processes", "max_output_chars", "max_file_mb",
                     "max_scratch_mb", "max_open_files"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"sandbox {name} must be a positive number, got {value!r}")
        lo_hi = self.uid_range
        if (not isinstance(lo_hi, tuple) or len(lo_hi) != 2 or not all(isinstance(u, int) for u in lo_hi)
                or not 0 < lo_hi[0] <= lo_hi[1]):
            raise ValueError(f"sandbox uid_range must be [first, last] with 0 < first <= last, got {lo_hi!r}")
        for name in ("isolate_network", "isolate_files", "private_tmp", "run_as_root", "allow_site_packages"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"sandbox {name} must be true or false, got {getattr(self, name)!r}")
        if self.run_as_root and self.user is not None:
            raise ValueError("sandbox: set either user (run as that user) or run_as_root (keep root), not both")
        parent = self.cgroup_parent
        if parent is not None and (not isinstance(parent, str) or not os.path.isabs(parent)
                                   or not os.path.isfile(os.path.join(parent, "cgroup.subtree_control"))):
            raise ValueError(f"sandbox cgroup_parent must be the absolute path of a cgroup v2 folder (one with "
                             f"cgroup.subtree_control), got {parent!r}; create and delegate one, or leave it unset")


@dataclass(frozen=True)
class SandboxResult:
    """Outcome of one run."""

    stdout: str
    """Captured stdout (possibly truncated)."""
    stderr: str
    """Captured stderr (possibly truncated)."""
    returncode: int | None
    """Exit status; negative is the signal that killed it; None if it never exited cleanly."""
    timed_out: bool
    """True when the wall-clock limit killed it."""
    truncated: bool
    """True when stdout or stderr was cut."""
    duration_s: float
    """Wall-clock seconds."""
    scratch_exceeded: bool = False
    """True when the polled scratch-size check killed it (with a tmpfs the code gets ENOSPC instead)."""
    isolation: tuple[str, ...] = ()
    """Mechanisms the run had besides rlimits and the subreaper: ``dedicated-uid``, ``user``,
    ``isolated-network``, ``isolated-files``, ``private-tmpfs``, ``cgroup`` (killed with ``cgroup.kill``), ``cgroup-memory``
    (``run_memory_mb`` held), ``cgroup-pids`` (``max_processes`` held per run)."""
    memory_peak_bytes: int | None = None
    """Most memory the run's processes held at once, from its memory cgroup; None where unknown."""
    memory_exceeded: bool = False
    """True when the kernel killed processes of the run at ``run_memory_mb``."""
    unenforced: tuple[str, ...] = ()
    """Per-run limits this host did not let the sandbox enforce, each with why and the fix."""


_warned: set[str] = set()


def _warn_unenforced(reasons: list[str]) -> None:
    """Log each reason a per-run limit does not hold once per process (every result carries them)."""
    for reason in reasons:
        if reason not in _warned:
            _warned.add(reason)
            logger.warning("sandbox: %s", reason)


def check_isolation(limits: SandboxLimits) -> None:
    """Start a supervisor that only enters the namespaces ``limits`` ask for, so that a host
    that cannot give them fails when the tool is made, not at the first rollout. Cached.

    Raises:
        RuntimeError: The isolation cannot be had here, naming the fix.
    """
    probe_isolation(isolate_network=limits.isolate_network, isolate_files=limits.isolate_files,
                    private_tmp=limits.private_tmp)


async def run_python(code: str, limits: SandboxLimits = SandboxLimits()) -> SandboxResult:
    """Run Python source in a fresh, limited subprocess and capture its output.

    Args:
        code: Python source.
        limits: Resource limits.

    Returns:
        The captured output and how the process ended.

    Raises:
        ValueError: ``code`` is not a string, the sandbox user does not exist, or no interpreter
            can be run by the unprivileged uid.
        RuntimeError: Every uid of ``uid_range`` is taken, the supervisor could not start, or this
            host cannot give the code the isolation ``limits`` ask for (``isolate_network``,
            ``isolate_files``); the message names the fix.
    """
    if not isinstance(code, str):
        raise ValueError(f"code must be a string, got {type(code).__name__}")
    as_root = os.geteuid() == 0
    lease: UidLease | None = None
    uid = gid = None
    isolation: list[str] = []
    if as_root and not limits.run_as_root:
        if limits.user is not None:
            uid, gid = resolve_user(limits.user)
            isolation.append("user")
        else:
            lease = UidLease(*limits.uid_range)
            uid = gid = lease.uid
            isolation.append("dedicated-uid")
    name = f"agentloop-sandbox-{uuid.uuid4().hex[:12]}"
    marker = f"AGENTLOOP_SANDBOX={name}"
    start = time.monotonic()
    proc = None
    status_r = status_w = -1
    workdir = None
    cfg_name = name  # the scratch folder's name once made; the sweep needs one either way
    try:
        python = interpreter.choose(limits.python_executable, dropped=uid is not None)
        keep: tuple[str, ...] = ()
        view: dict[str, list] = {"binds": [], "links": []}
        if limits.isolate_files:
            view = await asyncio.to_thread(interpreter.file_view, python, limits.allow_site_packages, rootfs.SYSTEM_DIRS)
        elif limits.private_tmp:
            keep = await asyncio.to_thread(interpreter.masked_paths, python, limits.allow_site_packages)
        workdir = tempfile.mkdtemp(prefix=f"{name}-")
        cfg_name = os.path.basename(workdir)
        main_py = os.path.join(workdir, "main.py")
        await asyncio.to_thread(write_text, main_py, code)
        if uid is not None and gid is not None:  # set together
            os.chown(workdir, uid, gid)
            os.chown(main_py, uid, gid)
        status_r, status_w = os.pipe()
        # Only what Python needs to start; nothing from the parent (API keys, tokens, paths).
        env = {"LC_ALL": "C.UTF-8", "PATH": "/usr/bin:/bin", marker.split("=")[0]: name}
        cfg = {
            "name": cfg_name, "scratch": workdir, "uid": uid, "gid": gid,
            "dedicated_uid": lease is not None, "python": python,
            "python_args": ["-I"] + ([] if limits.allow_site_packages else ["-S"]),
            "env": env, "status_fd": status_w, "timeout_s": float(limits.timeout_s),
            "memory_bytes": int(limits.memory_mb * 2**20), "cpu_s": int(limits.timeout_s) + 1,
            "file_bytes": int(limits.max_file_mb * 2**20), "max_open_files": int(limits.max_open_files),
            "max_processes": int(limits.max_processes), "scratch_mb": int(limits.max_scratch_mb),
            "private_tmp": limits.private_tmp, "cgroup": True, "keep_visible": list(keep),
            "isolate_network": limits.isolate_network, "isolate_files": limits.isolate_files, "view": view,
            "run_memory_bytes": int(limits.run_memory_mb * 2**20), "cgroup_parent": limits.cgroup_parent,
        }
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-I", "-S", supervisor.__file__, json.dumps(cfg),
            stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            env=env, pass_fds=(status_w,), start_new_session=True,
        )
        os.close(status_w)
        status_w = -1
        out, err = Capture(limits.max_output_chars, "head"), Capture(limits.max_output_chars, "tail")
        stdout, stderr = proc.stdout, proc.stderr
        assert stdout is not None, "stdout is a PIPE"
        assert stderr is not None, "stderr is a PIPE"
        readers = asyncio.gather(out.drain(stdout), err.drain(stderr))
        stalled = not await wait_exit(proc, limits.timeout_s + _GRACE_S)
        if stalled:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await wait_exit(proc, _GRACE_S)
        status = read_status(status_r)
        if status is None:  # the supervisor was killed or crashed: clean up from here
            sweep(marker, lease.uid if lease else None, cfg_name, limits.cgroup_parent)
            if not stalled and proc.returncode != -signal.SIGKILL:
                raise RuntimeError(f"sandbox supervisor exited with {proc.returncode} before reporting; its "
                                   f"stderr ends: {err.text()[0][-2000:]}")
            # Killed by us past its grace, or (as a normal user) by the code itself.
            status = {"returncode": None, "reason": "timeout" if stalled else "supervisor-killed", "isolation": []}
        # Every process of the run is gone, so the pipes are at EOF; the deadline only matters
        # if something escaped anyway. Partial output read so far is kept.
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(asyncio.shield(readers), _PIPE_GRACE_S)
        if not readers.done():
            readers.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await readers
        (stdout, out_cut), (stderr, err_cut) = out.text(), err.text()
        if status["reason"] == "isolation-refused":
            raise RuntimeError(refusal(status.get("refused") or []))
        timed_out = status["reason"] == "timeout"
        if status["reason"] == "supervisor-killed":
            stderr = (stderr + "\n" if stderr else "") + "sandbox: the supervisor was killed; every process of the run was killed"
        if timed_out:
            stderr = (stderr + "\n" if stderr else "") + f"TimeoutError: killed after {limits.timeout_s:g} s"
        scratch_exceeded = status["reason"] == "scratch"
        if scratch_exceeded:
            stderr = (stderr + "\n" if stderr else "") + (
                f"OSError: scratch space over {limits.max_scratch_mb} MiB; the run was killed")
        oom_kills = int(status.get("oom_kills") or 0)
        if oom_kills:
            stderr = (stderr + "\n" if stderr else "") + (
                f"MemoryError: the run's processes together reached run_memory_mb={limits.run_memory_mb:g} MiB; "
                f"the kernel killed {oom_kills} of them")
        unenforced = list(status.get("unenforced") or [])
        _warn_unenforced(unenforced)
        return SandboxResult(
            stdout=stdout, stderr=stderr, returncode=status["returncode"], timed_out=timed_out,
            truncated=out_cut or err_cut, duration_s=time.monotonic() - start, scratch_exceeded=scratch_exceeded,
            isolation=tuple(isolation + status["isolation"]), memory_peak_bytes=status.get("memory_peak_bytes"),
            memory_exceeded=oom_kills > 0, unenforced=tuple(unenforced),
        )
    finally:
        if proc is not None and proc.returncode is None:
            # Cancelled mid-run: the supervisor kills the code on SIGTERM and reports.
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
            try:
                if not await wait_exit(proc, _GRACE_S):
                    proc.kill()
                    sweep(marker, lease.uid if lease else None, cfg_name, limits.cgroup_parent)
            except asyncio.CancelledError:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                sweep(marker, lease.uid if lease else None, cfg_name, limits.cgroup_parent)
                raise
        for fd in (status_r, status_w):
            if fd >= 0:
                os.close(fd)
        if workdir is not None:
            remove_tree(workdir)
        if lease is not None:
            lease.release()


class PythonSandboxTool(BaseTool):
    """Tool ``python``: runs the model's code with :func:`run_python` and returns its output.

    Config keys (all optional): ``timeout_s`` (wall-clock limit), and every other
    :class:`SandboxLimits` field by name (``memory_mb``, ``max_scratch_mb``, ``user``,
    ``uid_range``, ``run_as_root``...).
    """

    def __init__(self, config: dict[str, Any] | None = None, tool_schema: Any = None) -> None:
        super().__init__(config, tool_schema)
        known = set(SandboxLimits.__dataclass_fields__)
        unknown = sorted(set(self.config) - known - {"type"})
        if unknown:
            raise ValueError(f"PythonSandboxTool: unknown config keys {unknown}; known: {sorted(known)}")
        # A little headroom so the loop's own timeout_s does not fire before the sandbox kills.
        self.limits = SandboxLimits(**{k: v for k, v in self.config.items() if k in known})
        if self.timeout_s is not None:
            self.timeout_s = self.timeout_s + 5.0
        dropped = os.geteuid() == 0 and not self.limits.run_as_root
        if dropped and self.limits.user is not None:
            resolve_user(self.limits.user)
        python = interpreter.choose(self.limits.python_executable, dropped=dropped)
        # Fail here, naming the fix, rather than at the first rollout.
        if self.limits.isolate_files:
            interpreter.file_view(python, self.limits.allow_site_packages, rootfs.SYSTEM_DIRS)
        elif self.limits.private_tmp:  # the tmpfs would hide the interpreter itself
            interpreter.masked_paths(python, self.limits.allow_site_packages)
        check_isolation(self.limits)

    def default_tool_schema(self) -> OpenAIFunctionToolSchema:
        return OpenAIFunctionToolSchema.model_validate(
            {
                "type": "function",
                "function": {
                    "name": "python",
                    "description": "Run Python code and return what it prints (stdout, then stderr).",
                    "parameters": {
                        "type": "object",
                        "properties": {"code": {"type": "string", "description": "Python source to run."}},
                        "required": ["code"],
                    },
                },
            }
        )

    async def execute(  # pyright: ignore[reportIncompatibleMethodOverride] - reads no execute_kwargs
        self, instance_id: str, parameters: dict[str, Any]
    ) -> tuple[ToolResponse, float, dict[str, Any]]:
        self.state(instance_id)
        result = await run_python(parameters.get("code", ""), self.limits)
        text = result.stdout
        if result.stderr:
            if text and not text.endswith("\n"):
                text += "\n"
            text = f"{text}[stderr]\n{result.stderr}"
        metrics = {
            "sandbox_duration_s": result.duration_s,
            "sandbox_timed_out": result.timed_out,
            "sandbox_returncode": result.returncode,
            "sandbox_truncated": result.truncated,
            "sandbox_scratch_exceeded": result.scratch_exceeded,
            "sandbox_memory_exceeded": result.memory_exceeded,
        }
        if result.memory_peak_bytes is not None:
            metrics["sandbox_memory_peak_mb"] = result.memory_peak_bytes / 2**20
        return ToolResponse(text=text), 0.0, metrics
