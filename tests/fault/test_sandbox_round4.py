"""Hostile sandbox code, round four: the policy under optimisation is the adversary, and the
machine it runs on holds what it wants: services on loopback started without a key (an engine
server, a gateway, a database) and the run's own training data, ground-truth answers included,
readable by others. The code tries to reach them; every attempt must fail because the code has a
network namespace and a file view of its own (``isolate_network``, ``isolate_files``), not
because of a permission it might find a way around.

Debugging: ``SandboxResult.isolation`` says what the run had (``isolated-network``,
``isolated-files``); the code's stdout says what each attempt got. Where the host refuses the
namespaces, every run raises ``RuntimeError`` naming the fix (the last test shows it).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from agentloop_tools.builtin.sandbox import SandboxLimits, SandboxResult, run_python

HERE = Path(__file__).parent
ANSWER = f"ground-truth-{uuid.uuid4().hex}"  # what the fake dataset holds and the code must not print


def _namespaces_allowed() -> str | None:
    """Why this host cannot make the namespaces the sandbox needs, or None."""
    if os.geteuid() == 0:
        probe = ["unshare", "--net", "--mount", "true"]
    else:
        probe = ["unshare", "--user", "--map-current-user", "--net", "--mount", "true"]
    if shutil.which("unshare") is None:
        return "no unshare(1) to probe namespaces with"
    proc = subprocess.run(probe, capture_output=True, text=True, timeout=30)
    return None if proc.returncode == 0 else f"this host refuses namespaces ({proc.stderr.strip()})"


_WHY_NOT = _namespaces_allowed()
needs_namespaces = pytest.mark.skipif(_WHY_NOT is not None, reason=f"needs network and mount namespaces: {_WHY_NOT}")


def run(code: str, **limits) -> SandboxResult:
    limits.setdefault("timeout_s", 10.0)
    return asyncio.run(asyncio.wait_for(run_python(code, SandboxLimits(**limits)), timeout=60))


@pytest.fixture
def listener() -> Iterator[tuple[int, list[str]]]:
    """A TCP server on all of this machine's addresses (127.0.0.1 included) that records who
    connected: an engine server or gateway started without a key."""
    srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("0.0.0.0", 0))
    srv.listen(8)
    srv.settimeout(0.2)
    seen: list[str] = []
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, addr = srv.accept()
            except OSError:
                continue
            seen.append(addr[0])
            conn.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield srv.getsockname()[1], seen
    stop.set()
    thread.join(5)
    srv.close()


def _host_addresses() -> list[str]:
    """This machine's IPv4 addresses other than loopback (``hostname -I``)."""
    try:
        out = subprocess.run(["hostname", "-I"], capture_output=True, text=True, timeout=10).stdout
    except OSError:
        return []
    return [a for a in out.split() if "." in a and not a.startswith("127.")]


@pytest.fixture
def run_data() -> Iterator[list[Path]]:
    """A fake ``train.parquet`` holding the answers, mode 0644 in 0755 folders: one outside every
    temp folder (next to this test, as a checkout's data folder would be) and one in the system
    temp folder."""
    outside = HERE / f".round4-data-{uuid.uuid4().hex}"
    inside_tmp = Path(os.environ.get("TMPDIR", "/tmp")) / f"agentloop-round4-data-{uuid.uuid4().hex}"
    files = []
    for folder in (outside, inside_tmp):
        folder.mkdir(mode=0o755)
        folder.chmod(0o755)
        data = folder / "train.parquet"
        data.write_text(f"question,answer\nwhat is 6*7,{ANSWER}\n")
        data.chmod(0o644)
        files.append(data)
    yield files
    for folder in (outside, inside_tmp):
        shutil.rmtree(folder, ignore_errors=True)


# ---- the network -------------------------------------------------------------------------------


@needs_namespaces
def test_code_cannot_reach_a_service_on_the_hosts_loopback(listener):
    """A server on 127.0.0.1 must get no connection from the code: the code's 127.0.0.1 is its
    own (a network namespace). Fails with 'CONNECTED' in stdout when the sandbox shares the host's
    network; check ``isolated-network`` in ``res.isolation`` and ``unshare(CLONE_NEWNET)``."""
    port, seen = listener
    code = (
        "import socket\n"
        "try:\n"
        f"    socket.create_connection(('127.0.0.1', {port}), timeout=3); print('CONNECTED')\n"
        "except OSError as e:\n"
        "    print('refused', type(e).__name__)\n"
    )
    res = run(code)
    assert res.returncode == 0, res.stderr
    assert "CONNECTED" not in res.stdout, res.stdout
    assert "refused" in res.stdout, (res.stdout, res.stderr)
    assert seen == [], f"the host's loopback server was reached from {seen}"
    assert "isolated-network" in res.isolation, res.isolation


@needs_namespaces
def test_code_cannot_reach_the_host_by_its_other_addresses_udp_dns_or_abstract_sockets(listener):
    """No way out of the network namespace: the machine's own non-loopback addresses, a UDP
    socket on 127.0.0.1, DNS, and an abstract unix socket (those are per network namespace too)
    must all fail. Each attempt prints what it got; 'REACHED' means a way out."""
    port, seen = listener
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    udp.bind(("127.0.0.1", 0))
    udp.settimeout(0.5)
    abstract = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    name = f"agentloop-round4-{uuid.uuid4().hex}"
    abstract.bind("\0" + name)
    abstract.listen(1)
    addresses = _host_addresses()
    code = (
        "import socket\n"
        f"for host in {addresses!r}:\n"
        "    try:\n"
        f"        socket.create_connection((host, {port}), timeout=3); print('REACHED', host)\n"
        "    except OSError as e:\n"
        "        print('no route', host, type(e).__name__)\n"
        "s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n"
        "try:\n"
        f"    s.sendto(b'hello', ('127.0.0.1', {udp.getsockname()[1]}))\n"
        "except OSError as e:\n"
        "    print('udp', type(e).__name__)\n"
        "try:\n"
        "    print('REACHED dns', socket.getaddrinfo('example.com', 80)[0][4])\n"
        "except OSError as e:\n"
        "    print('dns', type(e).__name__)\n"
        "u = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)\n"
        "try:\n"
        f"    u.connect('\\0{name}'); print('REACHED abstract')\n"
        "except OSError as e:\n"
        "    print('abstract', type(e).__name__)\n"
    )
    try:
        res = run(code)
        try:
            got_udp = udp.recvfrom(64)
        except OSError:
            got_udp = None
    finally:
        udp.close()
        abstract.close()
    assert res.returncode == 0, res.stderr
    assert "REACHED" not in res.stdout, res.stdout
    assert got_udp is None, f"a UDP datagram from the code reached the host: {got_udp}"
    assert seen == [], f"the host's server was reached from {seen}"


# ---- the files ---------------------------------------------------------------------------------


@needs_namespaces
def test_code_cannot_read_the_runs_training_data_however_readable(run_data):
    """The run's dataset, mode 0644 in 0755 folders (outside the temp folders and inside), must
    not be there for the code at all: a model that reads its answers hacks its reward. Fails with
    'READ' in stdout when the code sees the host's files (``isolate_files`` off or not applied)."""
    code = (
        f"for path in {[str(p) for p in run_data]!r}:\n"
        "    try:\n"
        "        print('READ', open(path).read())\n"
        "    except OSError as e:\n"
        "        print('absent', type(e).__name__)\n"
    )
    res = run(code)
    assert res.returncode == 0, res.stderr
    assert ANSWER not in res.stdout, res.stdout
    assert res.stdout.split() == ["absent", "FileNotFoundError"] * 2, res.stdout
    assert "isolated-files" in res.isolation, res.isolation


@needs_namespaces
def test_code_sees_only_its_own_folders_and_the_system_read_only():
    """Listing ``/`` shows the system's folders and the interpreter's, nothing of the host's
    homes, configuration, processes or checkout; ``/proc`` is not there to walk the trainer's
    environment or open files through. Fails listing what the code saw that it should not."""
    code = (
        "import os, sys\n"
        "print('ROOT', ' '.join(sorted(os.listdir('/'))))\n"
        f"for path in ('/home', '/root', '/etc', '/proc', '/sys', '/run', {str(HERE)!r}, {str(Path.cwd())!r}):\n"
        "    print('SEEN' if os.path.exists(path) else 'absent', path)\n"
    )
    res = run(code)
    assert res.returncode == 0, res.stderr
    seen = [line for line in res.stdout.splitlines() if line.startswith("SEEN")]
    assert seen == [], seen
    top = set(res.stdout.splitlines()[0].split()[1:])
    system = {"bin", "dev", "lib", "lib32", "lib64", "libx32", "sbin", "tmp", "usr", "var"}
    # The interpreter's own folders may add a top folder (a venv under /opt); the host's others may not.
    interpreter_tops = {Path(p).parts[1] for p in (sys.prefix, sys.base_prefix, os.path.realpath(sys.executable))
                        if len(Path(p).parts) > 1}
    assert top <= system | interpreter_tops, f"unexpected folders in the code's /: {top - system - interpreter_tops}"


@needs_namespaces
def test_code_cannot_write_outside_its_own_folders():
    """World-writable folders of the host outside the temp folders (``/run/lock``, a 0777 folder
    of the trainer's) and the system folders must stay untouched; the code's working directory,
    ``/tmp``, ``/var/tmp`` and ``/dev/shm`` are its own. Fails naming the host file the code made."""
    open_dir = HERE / f".round4-open-{uuid.uuid4().hex}"
    open_dir.mkdir()
    open_dir.chmod(0o777)
    tag = f"agentloop-round4-{uuid.uuid4().hex}"
    targets = [str(open_dir / tag), f"/run/lock/{tag}", f"/{tag}", f"/usr/{tag}", f"/usr/lib/{tag}"]
    code = (
        "import os\n"
        f"for path in {targets!r}:\n"
        "    try:\n"
        "        open(path, 'w').write('x'); print('WROTE', path)\n"
        "    except OSError as e:\n"
        "        print('refused', type(e).__name__)\n"
        f"for path in ('own.txt', '/tmp/{tag}', '/var/tmp/{tag}', '/dev/shm/{tag}'):\n"
        "    open(path, 'w').write('x'); print('own', path)\n"
    )
    try:
        res = run(code)
        made = [t for t in targets if os.path.exists(t)]
    finally:
        for t in targets:
            if os.path.exists(t) and t != f"/{tag}" and not t.startswith("/usr"):
                os.unlink(t)
        shutil.rmtree(open_dir, ignore_errors=True)
    assert res.returncode == 0, res.stderr
    assert made == [], f"the code wrote on the host: {made}"
    assert "WROTE" not in res.stdout, res.stdout
    assert res.stdout.count("own ") == 4, res.stdout


# ---- ordinary code still runs --------------------------------------------------------------------


@needs_namespaces
def test_ordinary_code_still_runs_in_the_isolated_sandbox():
    """Arithmetic, printing, the standard library, files in the working directory, a child
    process and a process pool all work with both isolations on (the default)."""
    code = (
        "import json, math, re, subprocess, multiprocessing as mp, os\n"
        "print(math.factorial(20), json.dumps({'a': [1, 2]}), re.findall(r'\\d+', 'x12y345'))\n"
        "open('notes.txt', 'w').write('kept'); print(open('notes.txt').read(), os.getcwd())\n"
        "print(subprocess.run(['echo', 'child'], capture_output=True, text=True).stdout.strip())\n"
        "def square(x):\n"
        "    return x * x\n"
        "if __name__ == '__main__':\n"
        "    with mp.Pool(2) as pool:\n"
        "        print(pool.map(square, range(5)))\n"
    )
    res = run(code)
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert lines[0] == "2432902008176640000 {\"a\": [1, 2]} ['12', '345']", lines
    assert lines[1].startswith("kept /tmp/"), lines
    assert lines[2:] == ["child", "[0, 1, 4, 9, 16]"], lines
    assert {"isolated-network", "isolated-files"} <= set(res.isolation), res.isolation


# ---- a host that cannot isolate refuses ---------------------------------------------------------

REFUSAL_DRIVER = r"""
import asyncio, sys
from agentloop_tools.builtin.sandbox import PythonSandboxTool, SandboxLimits, run_python
try:
    PythonSandboxTool({})
    print("TOOL MADE")
except RuntimeError as exc:
    print("tool refused:", exc)
try:
    res = asyncio.run(run_python("print('RAN')", SandboxLimits(run_as_root=True)))
    print("RAN UNISOLATED", res.stdout)
except RuntimeError as exc:
    print("run refused:", exc)
res = asyncio.run(run_python("print('opted out')", SandboxLimits(run_as_root=True, isolate_network=False,
                                                                 isolate_files=False, private_tmp=False)))
print("opt-out:", res.stdout.strip(), res.isolation)
"""


@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs unshare(1) to make a host without namespaces")
def test_a_host_without_namespaces_refuses_to_run_the_code_naming_the_fix():
    """On a host that allows no new network or mount namespace (made here: a user namespace
    whose ``max_net_namespaces`` and ``max_mnt_namespaces`` are 0), making the tool and every run
    fail with a RuntimeError naming the sysctl and the opt-out keys; the code never runs
    unisolated unless the config says ``isolate_network: false`` and ``isolate_files: false``."""
    limits = "; ".join(f"echo 0 > /proc/sys/user/max_{kind}_namespaces" for kind in ("net", "mnt", "user"))
    script = f'{limits} && exec "$0" -c "$1"'
    proc = subprocess.run(["unshare", "--user", "--map-root-user", "sh", "-c", script, sys.executable, REFUSAL_DRIVER],
                          capture_output=True, text=True, timeout=120)
    if proc.returncode != 0 and "unshare" in proc.stderr and "TOOL" not in proc.stdout:
        pytest.skip(f"cannot make a user namespace here to simulate the host: {proc.stderr.strip()[-300:]}")
    out = proc.stdout
    assert "TOOL MADE" not in out, out + proc.stderr
    assert "RAN UNISOLATED" not in out, out + proc.stderr
    for line in ("tool refused:", "run refused:"):
        refusal = next((x for x in out.splitlines() if x.startswith(line)), "")
        for words in ("isolate_network: false", "isolate_files: false", "unprivileged_userns_clone", "network ("):
            assert words in refusal, out + proc.stderr
    opted = next((x for x in out.splitlines() if x.startswith("opt-out:")), "")
    assert opted.startswith("opt-out: opted out"), out + proc.stderr
    assert "isolated" not in opted, opted
