"""Hostile and careless sandbox setups, round three: an interpreter that lives under a folder the
sandbox masks (a virtual environment in the system temp folder), a run whose many children each
stay under the per-process memory limit but hold far more together, and a fork bomb as root
(where ``RLIMIT_NPROC`` does not apply).

The per-run limits come from a cgroup of the run's own (cgroup v2, or the v1 memory and pids
hierarchies of a hybrid host); where neither can be used here the tests skip and say why.
"""

from __future__ import annotations

import asyncio
import json
import os
import site
import subprocess
import sys
import tempfile
import venv
from pathlib import Path

import pytest

from agentloop_tools.builtin.sandbox import SandboxLimits, run_python

IS_ROOT = os.geteuid() == 0


def run(code: str, **limits) -> object:
    limits.setdefault("timeout_s", 20.0)
    return asyncio.run(asyncio.wait_for(run_python(code, SandboxLimits(**limits)), timeout=90))


# ---- an interpreter under a masked folder -------------------------------------------------------

PROBE = (
    "import os, sys\n"
    "print(sys.executable)\n"
    "print(sys.prefix)\n"
    "import venv_marker\n"
    "print('marker', venv_marker.VALUE)\n"
    "try:\n"
    "    open(os.path.join(sys.prefix, 'written-by-the-code'), 'w').close()\n"
    "    print('venv writable')\n"
    "except OSError as exc:\n"
    "    print('venv read-only', type(exc).__name__)\n"
    "print('sibling visible' if os.path.exists({sibling!r}) else 'sibling hidden')\n"
)

DRIVER = r"""
import asyncio, json, sys
from agentloop_tools.builtin.sandbox import SandboxLimits, run_python
out = []
for limits in json.loads(sys.argv[1]):
    res = asyncio.run(run_python(sys.argv[2], SandboxLimits(**limits)))
    out.append({"limits": limits, "returncode": res.returncode, "stdout": res.stdout, "stderr": res.stderr,
                "isolation": list(res.isolation)})
print(json.dumps(out))
"""


@pytest.fixture
def temp_venv():
    """A venv in the system temp folder (the folder the private tmpfs hides), whose
    site-packages reaches this test's packages, with a marker module of its own."""
    base = Path(tempfile.mkdtemp(prefix="agentloop-venv-"))
    base.chmod(0o755)  # as in a venv someone made with `python -m venv /tmp/venv`
    env_dir = base / "venv"
    venv.EnvBuilder(system_site_packages=True, symlinks=True, with_pip=False).create(env_dir)
    purelib = next(env_dir.glob("lib/python*/site-packages"))
    hosts = [p for p in site.getsitepackages() if os.path.isdir(p)]
    (purelib / "_host_site.pth").write_text("".join(f"import site; site.addsitedir({p!r})\n" for p in hosts))
    (purelib / "venv_marker.py").write_text("VALUE = 'from-the-temp-venv'\n")
    sibling = base / "host-secret.txt"
    sibling.write_text("the trainer's temp file")
    # For the dedicated uid, which cannot run an interpreter under /root: a venv of the system's.
    other = None
    if IS_ROOT and os.access("/usr/bin/python3", os.X_OK):
        other = base / "system-venv"
        subprocess.run(["/usr/bin/python3", "-m", "venv", "--without-pip", str(other)], check=True, timeout=60)
        next(other.glob("lib/python*/site-packages")).joinpath("venv_marker.py").write_text(
            "VALUE = 'from-the-temp-venv'\n")
    yield env_dir, other, sibling
    subprocess.run(["rm", "-rf", str(base)], check=False)


def test_an_interpreter_in_a_temp_folder_venv_runs_in_every_mode(temp_venv):
    env_dir, other, sibling = temp_venv
    python = str(env_dir / "bin" / "python")
    if IS_ROOT:
        modes = [{"run_as_root": True, "allow_site_packages": True}, {"run_as_root": True}]
        if other is not None:  # the default, a dedicated uid, with an interpreter it may run
            modes.append({"python_executable": str(other / "bin" / "python"), "allow_site_packages": True})
    else:
        modes = [{"allow_site_packages": True}]
    code = PROBE.format(sibling=str(sibling))
    proc = subprocess.run([python, "-c", DRIVER, json.dumps(modes), code], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    for res in json.loads(proc.stdout):
        prefix = str(other) if "python_executable" in res["limits"] else str(env_dir)
        lines = res["stdout"].splitlines()
        assert lines[:1] == [os.path.join(prefix, "bin", "python")], res  # the venv's, not a fallback
        if not res["limits"].get("allow_site_packages", False):
            # -S: no site-packages (and sys.prefix stays the base's), so the marker import fails
            assert "No module named 'venv_marker'" in res["stderr"], res
            continue
        assert res["returncode"] == 0, res
        assert lines[1] == prefix, res
        assert "marker from-the-temp-venv" in lines, res
        if "private-tmpfs" in res["isolation"]:
            # The venv is visible again, read-only; the rest of the host's /tmp stays hidden.
            assert any(line.startswith("venv read-only") for line in lines), res
            assert "sibling hidden" in lines, res
    assert not (env_dir / "written-by-the-code").exists()
    assert other is None or not (other / "written-by-the-code").exists()


# ---- per-run memory and process limits ----------------------------------------------------------


def _own_cgroup(controller: str) -> tuple[str, str] | None:
    """(version, folder) of this process's cgroup for ``controller``, if one is mounted."""
    with open("/proc/self/mountinfo") as f:
        mounts = [line.split() for line in f]
    with open("/proc/self/cgroup") as f:
        own = [line.strip().split(":", 2) for line in f]
    for m in mounts:
        fstype, opts = m[m.index("-") + 1], m[m.index("-") + 3].split(",")
        if fstype == "cgroup" and controller in opts:
            rel = next((c[2] for c in own if controller in c[1].split(",")), None)
            if rel is not None:
                return "1", os.path.join(m[4], rel.lstrip("/"))
    for m in mounts:
        if m[m.index("-") + 1] == "cgroup2":
            rel = next((c[2] for c in own if c[0] == "0"), None)
            if rel is not None:
                return "2", os.path.join(m[4], rel.lstrip("/"))
    return None


def _controller_usable(controller: str) -> str | None:
    """None if a per-run cgroup with ``controller`` can be made here, else why not."""
    found = _own_cgroup(controller)
    if found is None:
        return f"no cgroup hierarchy with the {controller} controller is mounted"
    version, folder = found
    if not os.access(folder, os.W_OK):
        return f"cgroup folder {folder} is not writable by this uid"
    if version == "2":
        with open(os.path.join(folder, "cgroup.controllers")) as f:
            if controller not in f.read().split():
                return f"cgroup v2 at {folder} has no {controller} controller"
        with open(os.path.join(folder, "cgroup.subtree_control")) as f:
            enabled = controller in f.read().split()
        if not enabled and os.path.realpath(folder) != "/sys/fs/cgroup":
            return f"{controller} is not in {folder}/cgroup.subtree_control (a delegated parent is needed)"
    return None


MEMORY_HOG_CHILDREN = r"""
import os, select, time
N, MB = {n}, {mb}
r, w = os.pipe()
for _ in range(N):
    if os.fork() == 0:
        os.close(r)
        block = b"\x01" * (MB << 20)  # written, so every page is resident
        os.write(w, os.getpid().to_bytes(4, "little"))
        time.sleep(30)
        os._exit(0)
os.close(w)
holding, dead, most = set(), set(), 0
deadline = time.monotonic() + 15
while len(holding | dead) < N and time.monotonic() < deadline:
    while True:  # reap first, so a child killed to make room is gone before the next report
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            break
        if pid == 0:
            break
        dead.add(pid)
    if select.select([r], [], [], 0.2)[0]:
        data = os.read(r, 4)
        if len(data) == 4:
            holding.add(int.from_bytes(data, "little"))
    most = max(most, len(holding - dead))
print("most_held_at_once", most, "killed", len(dead), flush=True)
"""


@pytest.mark.parametrize("as_root", [False, True], ids=["default", "run_as_root"])
def test_many_children_cannot_hold_more_than_the_run_memory_limit_together(as_root):
    if as_root and not IS_ROOT:
        pytest.skip("run_as_root only means something when started as root")
    why = _controller_usable("memory")
    if why is not None:
        pytest.skip(f"no per-run memory limit here: {why}")
    limit_mb, n, mb = 160, 16, 32  # 512 MiB asked for in total, 32 MiB per process (under memory_mb)
    res = run(MEMORY_HOG_CHILDREN.format(n=n, mb=mb), memory_mb=512, run_memory_mb=limit_mb, run_as_root=as_root)
    line = next((ln for ln in res.stdout.splitlines() if ln.startswith("most_held_at_once")), None)
    assert line is not None, (res.stdout, res.stderr)
    most = int(line.split()[1])
    # One child of margin: a child killed to make room may be reaped just after the next report.
    assert most * mb <= limit_mb + mb, f"{most} children held {most * mb} MiB at once (limit {limit_mb} MiB)"
    assert "cgroup-memory" in res.isolation, res.isolation
    assert res.memory_peak_bytes is None or res.memory_peak_bytes <= (limit_mb + 1) * 2**20
    assert res.memory_exceeded, res.stderr
    assert "run_memory_mb" in res.stderr


FORK_BOMB = r"""
import os, time
made = 0
for _ in range({tries}):
    try:
        pid = os.fork()
    except OSError as exc:
        print("refused", type(exc).__name__, flush=True)
        break
    if pid == 0:
        time.sleep(30)
        os._exit(0)
    made += 1
print("children", made, flush=True)
"""


@pytest.mark.parametrize("as_root", [False, True], ids=["default", "run_as_root"])
def test_a_fork_bomb_stops_at_the_run_process_limit(as_root):
    if as_root and not IS_ROOT:
        pytest.skip("run_as_root only means something when started as root")
    why = _controller_usable("pids")
    if why is not None and (as_root or not IS_ROOT):
        pytest.skip(f"no per-run process limit for this uid here: {why}")
    limit = 16
    res = run(FORK_BOMB.format(tries=120), max_processes=limit, run_as_root=as_root)
    line = next((ln for ln in res.stdout.splitlines() if ln.startswith("children")), None)
    assert line is not None, (res.stdout, res.stderr)
    made = int(line.split()[1])
    assert made < limit, f"{made} children started under max_processes={limit}"
    assert "refused" in res.stdout
    if why is None:
        assert "cgroup-pids" in res.isolation, res.isolation
