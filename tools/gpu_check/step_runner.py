"""The GPU check's step runner: each step is one subprocess with its own time budget, recorded
whatever happens to it, and a shared deadline that keeps the whole check under its total.

A step that runs past its budget is killed with its whole process group (a trainer's spawned
ranks and a server's threads go with it) and recorded as failed with ``timeout``; a failing or
killed step never stops the steps after it. A step reports its key numbers by printing one line
``GPU_CHECK_NUMBERS {json}`` (the last one wins), or through its ``parse`` hook, which reads the
step's whole output after it ends.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

NUMBERS_PREFIX = "GPU_CHECK_NUMBERS "
"""A step's output line that starts with this carries its key numbers as one JSON object."""
TAIL_LINES = 60
"""How many of a step's last output lines its record keeps."""
TAIL_CHARS = 8000
"""And at most this many characters of them (a long traceback line is cut from the front)."""
MIN_STEP_S = 5.0
"""A step that would get less than this (the total's deadline is that close) is not started."""
_RUNNING: set[int] = set()
"""Process groups of the steps running now (see :func:`kill_running`)."""


@dataclass
class Step:
    """One step of the check: a command, or a reason it does not run."""

    name: str
    """Short identifier, the key a reader looks the step up by (``gpu_tests``)."""
    title: str
    """One line saying what the step checks."""
    argv: Sequence[str] = ()
    """The command (empty when ``skip`` is set)."""
    budget_s: float = 60.0
    """Wall-clock seconds the step may run before it is killed and recorded as failed."""
    env: Mapping[str, str] | None = None
    """Variables added to (or, mapped to "", removed from) the runner's environment."""
    cwd: str | Path | None = None
    """Working directory (the runner's own when None)."""
    skip: str | None = None
    """Why the step does not run: set, the step is recorded as ``skip`` with this reason."""
    parse: Callable[[str], dict[str, Any]] | None = None
    """Reads the step's whole output after it ends; its dict is merged into the step's numbers."""
    check: Callable[[dict[str, Any]], str | None] | None = None
    """Given the numbers of a step that exited 0, why it still failed (None: it passed)."""


@dataclass
class StepResult:
    """What one step did: the record the result file keeps."""

    name: str
    title: str
    status: str
    """``pass``, ``fail`` or ``skip``."""
    seconds: float
    budget_s: float
    returncode: int | None = None
    reason: str | None = None
    """Why a step failed or was skipped (``timeout after 90 s``, ``exit code 1``, ...)."""
    numbers: dict[str, Any] = field(default_factory=dict)
    tail: str = ""
    """The last lines of the step's stdout and stderr, interleaved as they were written."""
    argv: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name, "title": self.title, "status": self.status, "seconds": round(self.seconds, 2),
            "budget_s": self.budget_s, "returncode": self.returncode, "reason": self.reason,
            "numbers": self.numbers, "argv": self.argv, "tail": self.tail,
        }


def tail_of(text: str, lines: int = TAIL_LINES, chars: int = TAIL_CHARS) -> str:
    """The last ``lines`` lines of ``text``, at most ``chars`` characters of them."""
    kept = "\n".join(text.rstrip().splitlines()[-lines:])
    return kept[-chars:]


def numbers_in(output: str) -> dict[str, Any]:
    """The last ``GPU_CHECK_NUMBERS {json}`` line's object; a line that is not valid JSON is
    reported under ``numbers_error`` rather than dropped."""
    for line in reversed(output.splitlines()):
        if line.startswith(NUMBERS_PREFIX):
            try:
                value = json.loads(line[len(NUMBERS_PREFIX):])
            except json.JSONDecodeError as exc:
                return {"numbers_error": f"unreadable {NUMBERS_PREFIX.strip()} line ({exc}): {line[:200]}"}
            return value if isinstance(value, dict) else {"numbers": value}
    return {}


def _environment(extra: Mapping[str, str] | None) -> dict[str, str]:
    env = dict(os.environ)
    for key, value in (extra or {}).items():
        if value == "":
            env.pop(key, None)
        else:
            env[key] = value
    return env


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL the step's whole process group (it was started as a session leader)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def running_groups() -> frozenset[int]:
    """The process groups of the steps running now."""
    return frozenset(_RUNNING)


def kill_running() -> None:
    """SIGKILL every running step's process group: each step is a session of its own, so a
    check stopped from outside (SIGTERM from ``timeout``) must take its steps down itself."""
    for pgid in list(_RUNNING):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)


def run_step(step: Step, budget_s: float | None = None) -> StepResult:
    """Run one step under ``budget_s`` (the step's own budget when None) and record it.

    Never raises for the step's own failures: a command that cannot start, exits non-zero or
    runs out of time is a ``fail`` record with the reason, so the next step still runs.
    """
    budget = step.budget_s if budget_s is None else budget_s
    base = {"name": step.name, "title": step.title, "budget_s": round(budget, 1), "argv": list(step.argv)}
    if step.skip is not None:
        return StepResult(status="skip", seconds=0.0, reason=step.skip, **base)
    start = time.perf_counter()
    with tempfile.TemporaryFile() as log:
        try:
            proc = subprocess.Popen(list(step.argv), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    env=_environment(step.env), cwd=step.cwd, start_new_session=True)
        except OSError as exc:
            return StepResult(status="fail", seconds=time.perf_counter() - start,
                              reason=f"could not start {step.argv[0]!r}: {exc}", **base)
        reason = None
        _RUNNING.add(proc.pid)
        try:
            returncode = proc.wait(timeout=budget)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            returncode = proc.returncode
            reason = f"timeout after {budget:.0f} s (the step's budget): killed with its process group"
        else:
            # The step's leader exited; anything it left running in its group goes too.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
        finally:
            _RUNNING.discard(proc.pid)
        seconds = time.perf_counter() - start
        log.seek(0)
        output = log.read().decode("utf-8", errors="replace")
    numbers = numbers_in(output)
    if step.parse is not None:
        try:
            numbers.update(step.parse(output))
        except Exception as exc:  # a broken reader must not lose the step's record
            numbers["parse_error"] = f"{type(exc).__name__}: {exc}"
    if reason is None and returncode != 0:
        reason = f"exit code {returncode}"
    if reason is None and step.check is not None:
        reason = step.check(numbers)
    return StepResult(status="fail" if reason else "pass", seconds=seconds, returncode=returncode,
                      reason=reason, numbers=numbers, tail=tail_of(output), **base)


@dataclass
class Deadline:
    """The whole check's time: each step gets its own budget or what is left, whichever is less."""

    total_s: float
    started: float = field(default_factory=time.perf_counter)

    def left(self) -> float:
        return self.total_s - (time.perf_counter() - self.started)

    def budget_for(self, step: Step) -> float:
        return min(step.budget_s, self.left())


def run_steps(steps: Sequence[Step], deadline: Deadline,
              on_result: Callable[[StepResult], None] | None = None) -> list[StepResult]:
    """Run ``steps`` in order, each under its share of ``deadline``; ``on_result`` sees each
    record as soon as it exists (the caller rewrites its result file, so a check killed from
    outside still leaves the steps it finished)."""
    results: list[StepResult] = []
    for step in steps:
        budget = deadline.budget_for(step)
        if step.skip is None and budget < MIN_STEP_S:
            step = Step(name=step.name, title=step.title, argv=step.argv, budget_s=step.budget_s,
                        skip=f"not started: {max(budget, 0):.0f} s left of the check's {deadline.total_s:.0f} s total")
        result = run_step(step, budget)
        results.append(result)
        if on_result is not None:
            on_result(result)
    return results
