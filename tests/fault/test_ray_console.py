"""What Ray workers print reaches the driver's console escaped: Ray copies every line a worker
writes to stdout/stderr onto the driver's console (``log_to_driver``, on by default when joining
a cluster), so model or tool text printed in a rollout worker or engine replica could retitle
(``ESC ] 0 ; ... BEL``), clear (``ESC [ 2 J``) or rewrite the terminal of whoever watches the run.

Each driver runs in a fresh interpreter with its stdout and stderr on pipes; an actor prints
both sequences, then a marker; the test reads the driver's output until the marker arrives.
``RAY_COLOR_PREFIX=0`` turns off the colours Ray puts on its own ``(pid=...)`` prefix, so any ESC
left in the output came from the worker.

How to debug a failure: the escaping is ``agentloop_engines.fleet.hosting.cluster.escape_worker_output``
(called by ``connect_ray`` and ``init_local_ray`` after ``ray.init``); a raw ESC means the handler
Ray registers (``ray._private.ray_logging.global_worker_stdstream_dispatcher``, named
``ray_print_logs``) was not wrapped, e.g. Ray renamed it or ``ray.init`` was called directly.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

pytest.importorskip("ray", reason='the Ray console tests need Ray: pip install "agentloop-engines[ray]"')

MARKER = "agentloop-console-test-done"

HOLDER = r"""
import sys, tempfile
from agentloop_engines.fleet.hosting import init_local_ray

ray = init_local_ray(tempfile.mkdtemp(prefix="agentloop-console-"), num_cpus=1)
print("GCS " + ray.get_runtime_context().gcs_address, flush=True)
sys.stdin.read()  # until the test closes stdin
ray.shutdown()
"""

DRIVER = r"""
import sys, tempfile
from agentloop_engines.fleet.hosting import connect_ray, init_local_ray

if sys.argv[1] == "local":
    ray = init_local_ray(tempfile.mkdtemp(prefix="agentloop-console-"), num_cpus=1, log_to_driver=True)
else:
    ray = connect_ray(sys.argv[1])


@ray.remote(num_cpus=0)
class Talker:
    def talk(self):
        print("title \x1b]0;pwned\x07 clear \x1b[2J out", flush=True)
        print("stderr \x1b]0;pwned\x07 \x1b[2J err", file=sys.stderr, flush=True)
        print("MARKER", flush=True)


talker = Talker.remote()
ray.get(talker.talk.remote(), timeout=120)
sys.stdin.read()  # until the test has seen the marker
ray.shutdown()
""".replace("MARKER", MARKER)


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(RAY_COLOR_PREFIX="0", RAY_AUTH_MODE="disabled", PYTHONUNBUFFERED="1")
    return env


def _start(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, env=_env(), start_new_session=True)


def _read_until(proc: subprocess.Popen, needle: str, timeout_s: float = 240.0) -> str:
    """The process's output up to the line holding ``needle`` (a line at a time)."""
    assert proc.stdout is not None
    seen: list[bytes] = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        seen.append(line)
        if needle.encode() in line:
            return b"".join(seen).decode(errors="replace")
    raise AssertionError(f"no {needle!r} in the output (exit {proc.poll()}): "
                         f"{b''.join(seen).decode(errors='replace')[-3000:]}")


def _stop(proc: subprocess.Popen) -> str:
    assert proc.stdin is not None
    assert proc.stdout is not None
    proc.stdin.close()
    try:
        rest = proc.stdout.read()
        proc.wait(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()
        rest = b""
    finally:
        proc.stdout.close()
    return rest.decode(errors="replace")


@pytest.fixture
def processes() -> Iterator[list[subprocess.Popen]]:
    started: list[subprocess.Popen] = []
    yield started
    for proc in started:
        if proc.poll() is None:
            _stop(proc)


def _assert_escaped(output: str) -> None:
    for line in ("title", "stderr"):
        assert line in output, f"the worker's lines did not reach the console: {output[-3000:]}"
    for raw in ("\x1b", "\x07"):
        assert raw not in output, f"raw escape sequences on the console: {output[-3000:]!r}"
    for shown in ("\\x1b]0;pwned\\x07", "\\x1b[2J"):
        assert shown in output, output[-3000:]


def test_a_joined_cluster_prints_worker_output_escaped(processes):
    """A driver joining a running cluster (``connect_ray(address)``, Ray's ``log_to_driver`` on):
    the actor's title and clear-screen sequences reach its console as visible ``\\x1b...`` text
    (before: raw)."""
    holder = _start(HOLDER)
    processes.append(holder)
    address = _read_until(holder, "GCS ").rsplit("GCS ", 1)[1].strip()
    driver = _start(DRIVER, address)
    processes.append(driver)
    output = _read_until(driver, MARKER)
    output += _stop(driver)
    _assert_escaped(output)


def test_a_local_cluster_with_log_to_driver_prints_worker_output_escaped(processes):
    """``init_local_ray(log_to_driver=True)`` (its default keeps worker output in the session's
    log files): the same (before: a TypeError, the keyword given twice)."""
    driver = _start(DRIVER, "local")
    processes.append(driver)
    output = _read_until(driver, MARKER)
    output += _stop(driver)
    _assert_escaped(output)
