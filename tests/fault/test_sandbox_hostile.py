"""Hostile sandbox code, round two: processes that leave the process group (``setsid``, double
fork, daemons holding or closing the output pipes), code that looks for the host's secrets or
writes where the trainer writes, and code that fills ``/tmp``, ``/dev/shm`` and its scratch space.

Each test asserts on what is left afterwards (processes, files), not on elapsed time; the
``asyncio.wait_for`` deadlines are only there so that a regression fails instead of hanging.
Tests that depend on the uid say so and skip for the other one (we usually run as root here).
"""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from pathlib import Path

import pytest

from agentloop_tools.builtin.sandbox import SandboxLimits, run_python

IS_ROOT = os.geteuid() == 0
HANG_S = 60  # what the hostile code sleeps: far past every limit below


def run(code: str, **limits) -> object:
    limits.setdefault("timeout_s", 3.0)
    # A generous outer deadline: the sandbox must return on its own, long before it.
    return asyncio.run(asyncio.wait_for(run_python(code, SandboxLimits(**limits)), timeout=45))


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (FileNotFoundError, ProcessLookupError):
        return False


def _gone(pids: list[int], within_s: float = 10.0) -> list[int]:
    """The pids still alive after waiting up to ``within_s`` (a reaped pid disappears at once;
    the wait only covers the kernel finishing a SIGKILL)."""
    deadline = time.monotonic() + within_s
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return [p for p in pids if _alive(p)]


def _pids(stdout: str) -> list[int]:
    return [int(tok) for tok in stdout.split() if tok.isdigit()]


# ---- the wall-clock limit holds whatever the code does -----------------------------------------

DETACH = {
    # A child leaves the process group and keeps stdout open; the main process exits at once.
    "setsid_child_holds_stdout": (
        "import os, time\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        f"    os.setsid(); time.sleep({HANG_S}); os._exit(0)\n"
        "print(pid, flush=True)\n"
    ),
    # The same while the main process hangs too: the time limit must end both.
    "setsid_child_and_hanging_parent": (
        "import os, time\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        f"    os.setsid(); time.sleep({HANG_S}); os._exit(0)\n"
        "print(pid, flush=True)\n"
        f"time.sleep({HANG_S})\n"
    ),
    # A classic daemon: double fork, setsid, close the pipes, so nothing ties it to the run.
    "double_fork_daemon": (
        "import os, sys, time\n"
        "r, w = os.pipe()\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        "    if os.fork() == 0:\n"
        "        os.write(w, str(os.getpid()).encode()); os.close(w)\n"
        "        fd = os.open(os.devnull, os.O_RDWR)\n"
        "        for n in (0, 1, 2): os.dup2(fd, n)\n"
        f"        time.sleep({HANG_S}); os._exit(0)\n"
        "    os._exit(0)\n"
        "os.close(w)\n"
        "print(os.read(r, 32).decode(), flush=True)\n"
    ),
    # A grandchild in a new session that holds stderr and keeps forking workers.
    "setsid_forker": (
        "import os, sys, time\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        "    print(os.getpid(), flush=True)\n"
        "    for _ in range(20):\n"
        "        if os.fork() == 0:\n"
        f"            time.sleep({HANG_S}); os._exit(0)\n"
        "        time.sleep(0.05)\n"
        f"    time.sleep({HANG_S}); os._exit(0)\n"
        "time.sleep(0.3)\n"
    ),
}


@pytest.mark.parametrize("name", list(DETACH))
def test_processes_that_leave_the_group_neither_hold_the_call_nor_survive_it(name):
    res = run(DETACH[name], timeout_s=3.0)
    pids = _pids(res.stdout)
    assert pids, (res.stdout, res.stderr)
    assert _gone(pids) == [], f"{name}: detached processes outlived the sandbox call"


def test_code_that_kills_its_supervisor_still_leaves_nothing_behind():
    # As root the supervisor is out of the code's reach (another uid); as a normal user it is
    # not, and the trainer's own sweep (by the run's environment marker) has to catch the rest.
    code = (
        "import os, signal, time\n"
        "if os.fork() == 0:\n"
        f"    os.setsid(); time.sleep({HANG_S}); os._exit(0)\n"
        "print(os.getpid(), flush=True)\n"
        "try:\n"
        "    os.kill(os.getppid(), signal.SIGKILL)\n"
        "except PermissionError:\n"
        "    print('supervisor out of reach', flush=True)\n"
        f"time.sleep({HANG_S})\n"
    )
    res = run(code, timeout_s=3.0)
    assert _pids(res.stdout), (res.stdout, res.stderr)
    assert _gone(_pids(res.stdout)) == []
    if IS_ROOT:
        assert "supervisor out of reach" in res.stdout
        assert res.timed_out
    else:
        assert "the supervisor was killed" in res.stderr
        assert not res.timed_out


def test_a_timed_out_run_leaves_no_process_behind_in_the_new_session():
    res = run(DETACH["setsid_child_and_hanging_parent"], timeout_s=2.0)
    assert res.timed_out
    assert "killed after 2 s" in res.stderr
    assert _gone(_pids(res.stdout)) == []


# ---- root by default: unprivileged, no parent environment, no write access to the run folder ----


@pytest.mark.skipif(not IS_ROOT, reason="checks the default when started as root; we run as a normal user")
@pytest.mark.parametrize("isolate_files", [True, False], ids=["own-file-view", "host-files"])
def test_as_root_by_default_the_code_is_unprivileged_and_cannot_reach_the_trainer(tmp_path, monkeypatch,
                                                                                  isolate_files):
    monkeypatch.setenv("AGENTLOOP_FAKE_API_KEY", "sk-hostile-0123456789")
    # Where a trainer writes checkpoints: its working directory (./runs) and a root-owned 0755
    # folder (under /tmp here, which the sandbox sees as its own private tmpfs).
    name = f"pwned-{uuid.uuid4().hex}.txt"
    targets = [Path.cwd() / name, tmp_path / "run" / name]
    targets[1].parent.mkdir(mode=0o755)
    code = (
        "import os\n"
        "print('uid', os.getuid(), os.getgid(), os.getgroups())\n"
        f"for path in ('/proc/{os.getpid()}/environ', '/proc/1/environ', '/proc/{os.getppid()}/environ'):\n"
        "    try:\n"
        "        data = open(path, 'rb').read()\n"
        "        print('READ', path, b'sk-hostile' in data)\n"
        "    except OSError as e:\n"
        "        print('denied', path, type(e).__name__)\n"
        f"for path in {[str(t) for t in targets]!r}:\n"
        "    try:\n"
        "        open(path, 'w').write('x'); print('WROTE', path)\n"
        "    except OSError as e:\n"
        "        print('write denied', type(e).__name__)\n"
        "print('env', sorted(os.environ))\n"
    )
    try:
        res = run(code, isolate_files=isolate_files)
    finally:
        leaked = [t for t in targets if t.exists()]
        for t in leaked:
            t.unlink()
    assert res.returncode == 0, res.stderr
    uid_line = res.stdout.splitlines()[0].split()
    assert uid_line[0] == "uid", res.stdout
    assert uid_line[1] != "0", res.stdout
    assert uid_line[2] != "0", res.stdout
    assert uid_line[3] == "[]", res.stdout
    assert "READ" not in res.stdout, res.stdout
    assert "sk-hostile" not in res.stdout, res.stdout
    assert "WROTE" not in res.stdout, res.stdout
    assert leaked == [], res.stdout
    # The working directory is refused by permission where the sandbox can see it; a checkout
    # under a folder the sandbox masks (/tmp, /dev/shm, /var/tmp), or any with the code's own
    # file view (isolate_files), is not there at all.
    masked = isolate_files or any(Path.cwd().is_relative_to(m) for m in ("/tmp", "/dev/shm", "/var/tmp"))
    expected = "write denied FileNotFoundError" if masked else "write denied PermissionError"
    assert expected in res.stdout, res.stdout
    assert "AGENTLOOP_FAKE_API_KEY" not in res.stdout


@pytest.mark.skipif(IS_ROOT, reason="checks a normal user's run; as root the code runs as another uid (test above)")
def test_as_a_normal_user_the_code_runs_as_that_user_with_a_minimal_environment(monkeypatch):
    monkeypatch.setenv("AGENTLOOP_FAKE_API_KEY", "sk-hostile-0123456789")
    res = run("import os\nprint(os.getuid())\nprint(sorted(os.environ.items()))")
    assert res.returncode == 0, res.stderr
    assert res.stdout.splitlines()[0] == str(os.getuid())
    assert "sk-hostile" not in res.stdout
    assert "AGENTLOOP_FAKE_API_KEY" not in res.stdout


# ---- scratch space is private, bounded and cleaned ---------------------------------------------


@pytest.mark.parametrize("private_tmp", [True, False], ids=["private-tmpfs", "swept-by-owner"])
def test_files_in_tmp_and_dev_shm_do_not_outlive_the_run(private_tmp):
    if not private_tmp and not IS_ROOT:
        pytest.skip("without a private tmpfs a normal user's files in /tmp cannot be told apart from the "
                    "user's own (a documented limit); as root the run's own uid identifies them")
    tag = f"agentloop-hostile-{uuid.uuid4().hex}"
    code = (
        "import os, tempfile\n"
        f"open('/tmp/{tag}', 'w').write('x')\n"
        f"open('/dev/shm/{tag}', 'w').write('x')\n"
        f"open(os.path.join(tempfile.gettempdir(), '{tag}-tmpdir'), 'w').write('x')\n"
        "print(os.getcwd(), tempfile.gettempdir())\n"
    )
    res = run(code, private_tmp=private_tmp)
    if IS_ROOT:
        assert res.returncode == 0, res.stderr
    cwd = res.stdout.split()[0] if res.stdout else None
    left = [p for p in (f"/tmp/{tag}", f"/dev/shm/{tag}") if os.path.exists(p)]
    assert left == [], f"files the run created outlived it: {left}"
    assert cwd, "the scratch directory outlived the run"
    assert not os.path.exists(cwd), "the scratch directory outlived the run"
    assert not os.path.exists(f"/tmp/{tag}-tmpdir")  # TMPDIR pointed into the (removed) scratch


@pytest.mark.parametrize("private_tmp", [True, False], ids=["private-tmpfs", "polled"])
def test_scratch_space_is_bounded_in_total_and_removed_even_after_a_timeout(private_tmp):
    # Each file stays under max_file_mb, so only a total bound can stop this.
    code = (
        "import os\n"
        "print('cwd', os.getcwd(), flush=True)\n"
        "written = 0\n"
        "try:\n"
        "    for i in range(200):\n"
        "        with open(f'f{i}', 'wb') as f:\n"
        "            f.write(b'0' * 2**20)\n"
        "        written += 1\n"
        "except OSError as e:\n"
        "    print('stopped', type(e).__name__, flush=True)\n"
        "print('written', written, flush=True)\n"
        f"import time; time.sleep({HANG_S})\n"
    )
    res = run(code, max_file_mb=2, max_scratch_mb=16, timeout_s=3.0, private_tmp=private_tmp)
    words = res.stdout.split()
    assert words[:1] == ["cwd"], (res.stdout, res.stderr)
    if "private-tmpfs" in res.isolation:  # the kernel refuses the write past the tmpfs size
        assert "stopped OSError" in res.stdout, res.stdout
        assert res.timed_out, res.stdout
        assert int(words[words.index("written") + 1]) < 16, res.stdout
    else:  # the polled size check kills the run (it may overshoot by what it writes in 0.1 s)
        assert res.scratch_exceeded, (res.stdout, res.stderr)
        assert not res.timed_out, (res.stdout, res.stderr)
        assert "scratch space over 16 MiB" in res.stderr
    assert not os.path.exists(words[1])


def test_scratch_directory_is_removed_even_when_the_code_locks_it_down():
    code = (
        "import os\n"
        "os.makedirs('a/b')\n"
        "open('a/b/f', 'w').write('x')\n"
        "os.chmod('a/b', 0); os.chmod('a', 0)\n"
        "print(os.getcwd())\n"
    )
    res = run(code)
    assert res.returncode == 0, res.stderr
    assert not os.path.exists(res.stdout.strip())
