"""A Python code tool that runs model-written code in a limited subprocess.

What it enforces (Linux; POSIX ``resource`` limits):

- wall-clock time limit, then SIGKILL to the whole process group (``start_new_session``), so
  children the code forked die too, and nothing is left behind on the normal path;
- address-space limit (``RLIMIT_AS``) so a memory hog gets ``MemoryError``, not the host's OOM
  killer; CPU-seconds (``RLIMIT_CPU``), file-size (``RLIMIT_FSIZE``), open files and no core dumps;
- process limit (``RLIMIT_NPROC``). The kernel does not apply it to root: when this runs as root
  it only works together with ``user=`` (drop to an unprivileged uid such as ``nobody``; the
  limit then counts all processes of that uid, shared by concurrent sandboxes);
- stdout/stderr truncated to ``max_output_chars`` (the rest is read and discarded, so a
  chatty program cannot block on a full pipe);
- a fresh temporary working directory, deleted afterwards, and an environment with none of the
  parent's variables (no API keys leak); ``python -I`` ignores ``PYTHON*`` variables and the
  user site, ``-S`` also drops site-packages unless ``allow_site_packages``.

What it does NOT do: it is not a security boundary against a determined attacker. Code runs
with the host's network, can read any file its uid can read (as root: everything; use
``user="nobody"`` to limit that), and a process that calls ``setsid()`` escapes the group kill.
Use a container or VM (gVisor, Firecracker, nsjail) for untrusted code at scale.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

from agentloop_tools.base import BaseTool
from agentloop_tools.schema import OpenAIFunctionToolSchema, ToolResponse

__all__ = ["PythonSandboxTool", "SandboxLimits", "SandboxResult", "run_python"]


@dataclass(frozen=True)
class SandboxLimits:
    """Resource limits for one run."""

    timeout_s: float = 10.0
    """Wall-clock seconds before the process group is killed."""
    memory_mb: int = 512
    """Address-space limit per process (RLIMIT_AS), in MiB."""
    max_processes: int = 64
    """RLIMIT_NPROC; ineffective for root unless ``user`` is set."""
    max_output_chars: int = 8192
    """Characters kept of stdout (its head) and of stderr (its tail); the rest is dropped with a marker."""
    max_file_mb: int = 16
    """Largest file the code may write (RLIMIT_FSIZE), in MiB."""
    max_open_files: int = 64
    """RLIMIT_NOFILE."""
    python_executable: str = field(default_factory=lambda: sys.executable)
    """Interpreter to run; with ``user`` set it must be executable by that user (e.g. /usr/bin/python3)."""
    allow_site_packages: bool = False
    """Let the code import installed packages (drops ``-S``)."""
    user: str | int | None = None
    """Run as this user (name or uid) when started as root, so RLIMIT_NPROC and file permissions apply."""


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


def _preexec(limits: SandboxLimits, uid: int | None, gid: int | None):
    import resource

    mem = limits.memory_mb * 2**20
    cpu = int(limits.timeout_s) + 1
    fsize = limits.max_file_mb * 2**20

    def apply() -> None:  # runs in the child between fork and exec: keep it to syscalls
        resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu))
        resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
        resource.setrlimit(resource.RLIMIT_NOFILE, (limits.max_open_files, limits.max_open_files))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        resource.setrlimit(resource.RLIMIT_NPROC, (limits.max_processes, limits.max_processes))
        if uid is not None:
            os.setgroups([])
            os.setgid(gid)
            os.setuid(uid)

    return apply


def _resolve_user(user: str | int | None) -> tuple[int | None, int | None]:
    if user is None or os.geteuid() != 0:
        return None, None
    import pwd

    try:
        entry = pwd.getpwuid(user) if isinstance(user, int) else pwd.getpwnam(user)
    except KeyError:
        raise ValueError(f"sandbox user {user!r} does not exist; create it or set user=None") from None
    return entry.pw_uid, entry.pw_gid


async def _read_capped(stream: asyncio.StreamReader, limit: int, keep: str = "head") -> tuple[str, bool]:
    """Read a pipe to EOF, keeping ``limit`` characters from the head (stdout: the first
    results) or the tail (stderr: a traceback ends with the error)."""
    budget = limit * 4  # bytes; decoded and cut to characters below
    kept = bytearray()
    total = 0
    while chunk := await stream.read(65536):
        total += len(chunk)
        if keep == "head":
            kept += chunk[: max(budget - len(kept), 0)]
        else:
            kept = (kept + chunk)[-budget:]
    text = kept.decode("utf-8", errors="replace")
    truncated = total > len(kept) or len(text) > limit
    if not truncated:
        return text, False
    marker = f"... [output truncated to {limit} characters]"
    if keep == "head":
        return text[:limit] + "\n" + marker, True
    return marker + "\n" + text[-limit:], True


def _kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


async def run_python(code: str, limits: SandboxLimits = SandboxLimits()) -> SandboxResult:
    """Run Python source in a fresh, limited subprocess and capture its output.

    Args:
        code: Python source.
        limits: Resource limits.

    Returns:
        The captured output and how the process ended.

    Raises:
        ValueError: ``code`` is not a string or the sandbox user does not exist.
    """
    if not isinstance(code, str):
        raise ValueError(f"code must be a string, got {type(code).__name__}")
    uid, gid = _resolve_user(limits.user)
    workdir = tempfile.mkdtemp(prefix="agentloop-sandbox-")
    start = time.monotonic()
    proc = None
    try:
        script = os.path.join(workdir, "main.py")
        with open(script, "w", encoding="utf-8") as f:
            f.write(code)
        if uid is not None:
            os.chown(workdir, uid, gid)
            os.chown(script, uid, gid)
        args = [limits.python_executable, "-I"] + ([] if limits.allow_site_packages else ["-S"]) + [script]
        # Only what Python needs to start; nothing from the parent (API keys, tokens, paths).
        env = {"HOME": workdir, "TMPDIR": workdir, "LC_ALL": "C.UTF-8", "PATH": "/usr/bin:/bin"}
        proc = await asyncio.create_subprocess_exec(
            *args,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            cwd=workdir,
            env=env,
            start_new_session=True,
            preexec_fn=_preexec(limits, uid, gid),
        )
        readers = asyncio.gather(
            _read_capped(proc.stdout, limits.max_output_chars),
            _read_capped(proc.stderr, limits.max_output_chars, keep="tail"),
        )
        # proc.wait() also waits for the pipes to close, which a background child can hold open
        # forever; watch the main process's return code so its exit ends the run.
        loop = asyncio.get_running_loop()
        waiter = asyncio.ensure_future(proc.wait())
        deadline = loop.time() + limits.timeout_s
        while not waiter.done() and proc.returncode is None and loop.time() < deadline:
            await asyncio.wait({waiter}, timeout=min(0.02, max(deadline - loop.time(), 0)))
        timed_out = proc.returncode is None
        # Kill the group even after a clean exit, so no child outlives the run.
        _kill_group(proc.pid)
        await waiter
        (out, out_cut), (err, err_cut) = await asyncio.wait_for(readers, timeout=5.0)
        if timed_out:
            err = (err + "\n" if err else "") + f"TimeoutError: killed after {limits.timeout_s:g} s"
        return SandboxResult(
            stdout=out,
            stderr=err,
            returncode=proc.returncode,
            timed_out=timed_out,
            truncated=out_cut or err_cut,
            duration_s=time.monotonic() - start,
        )
    finally:
        if proc is not None and proc.returncode is None:
            _kill_group(proc.pid)
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()
        shutil.rmtree(workdir, ignore_errors=True)


class PythonSandboxTool(BaseTool):
    """Tool ``python``: runs the model's code with :func:`run_python` and returns its output.

    Config keys (all optional): ``timeout_s`` (wall-clock limit), and every other
    :class:`SandboxLimits` field by name (``memory_mb``, ``max_output_chars``, ``user``...).
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
        _resolve_user(self.limits.user)

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

    async def execute(
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
        }
        return ToolResponse(text=text), 0.0, metrics
