"""The Python sandbox: limits on time, memory, processes and output; clean env; no leftovers."""

import asyncio
import os
import shutil
import tempfile

import pytest

from agentloop_tools.builtin.sandbox import PythonSandboxTool, SandboxLimits, run_python


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            return not any(line.startswith("State:") and "Z" in line for line in f)
    except FileNotFoundError:
        return False


async def test_runs_code_in_fresh_temp_dir():
    result = await run_python("import os; print(6 * 7); print(os.getcwd()); print(os.listdir('.'))")
    out = result.stdout.splitlines()
    assert out[0] == "42"
    assert result.returncode == 0
    assert not result.timed_out
    assert "agentloop-sandbox-" in out[1]
    assert out[2] == "['main.py']"
    assert not os.path.exists(out[1])  # noqa: ASYNC240 - one local stat, nothing else runs; removed afterwards


async def test_infinite_loop_is_killed():
    code = "import os\nprint(os.getpid(), flush=True)\nwhile True: pass"
    # wait_for only turns a hang into a failure; the checks are on how the run ended.
    result = await asyncio.wait_for(run_python(code, SandboxLimits(timeout_s=1.0)), 60)
    assert result.timed_out
    assert result.returncode == -9
    assert "killed after 1 s" in result.stderr
    looping = int(result.stdout.split()[0])
    assert not _alive(looping), f"the looping process {looping} outlived its run"


async def test_memory_hog_gets_memory_error():
    result = await run_python("x = bytearray(2 * 1024**3)\nprint('allocated')", SandboxLimits(memory_mb=256))
    assert "MemoryError" in result.stderr
    assert "allocated" not in result.stdout
    assert result.returncode != 0


async def test_parent_env_vars_not_visible(monkeypatch):
    monkeypatch.setenv("AGENTLOOP_TEST_SECRET", "s3cr3t-value")
    # isolate_files: false, so /proc is there to read: the scrubbed environment holds on its own.
    result = await run_python("import os; print(sorted(os.environ)); print(open('/proc/self/environ').read())",
                              SandboxLimits(isolate_files=False))
    assert "s3cr3t-value" not in result.stdout
    assert "AGENTLOOP_TEST_SECRET" not in result.stdout
    assert result.returncode == 0


async def test_output_truncated():
    result = await run_python("print('a' * 100000)\nimport sys; sys.stderr.write('e' * 50000)", SandboxLimits(max_output_chars=100))
    assert result.truncated
    assert result.stdout.startswith("a" * 100)
    assert "output truncated to 100 characters" in result.stdout
    assert result.stderr.endswith("e" * 100)  # stderr keeps its tail, where a traceback's error is
    assert len(result.stdout) < 200
    assert len(result.stderr) < 200


async def test_no_leftover_processes():
    code = (
        "import os, sys, time\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    time.sleep(1000)\n"
        "print(pid, flush=True)\n"
    )
    result = await asyncio.wait_for(run_python(code, SandboxLimits(timeout_s=10)), 60)
    child = int(result.stdout.split()[0])
    # The main process exiting ends the run; it does not wait out the timeout for the child
    # (which would end it as timed out, killed by SIGKILL).
    assert result.returncode == 0, result
    assert not result.timed_out, result
    for _ in range(50):
        if not _alive(child):
            break
        await asyncio.sleep(0.05)
    assert not _alive(child), f"child {child} survived the sandbox run"


@pytest.mark.skipif(os.geteuid() != 0, reason="dropping to another user needs root")
@pytest.mark.skipif(not shutil.which("python3", path="/usr/bin"), reason="needs /usr/bin/python3, executable by 'nobody'")
async def test_process_limit_and_file_permissions_with_unprivileged_user():
    # As root RLIMIT_NPROC is ignored by the kernel; it applies once we drop to 'nobody'.
    # isolate_files: false, so /root is there: file permissions hold on their own.
    limits = SandboxLimits(user="nobody", python_executable="/usr/bin/python3", max_processes=8, timeout_s=5,
                           isolate_files=False)
    code = (
        "import os\n"
        "n = 0\n"
        "try:\n"
        "    for _ in range(50):\n"
        "        if os.fork() == 0:\n"
        "            import time; time.sleep(30); os._exit(0)\n"
        "        n += 1\n"
        "except OSError as e:\n"
        "    print('fork refused after', n, type(e).__name__)\n"
        "try:\n"
        "    open('/root/.bashrc').read()\n"
        "except OSError as e:\n"
        "    print('read refused', type(e).__name__)\n"
    )
    result = await run_python(code, limits)
    assert "fork refused after" in result.stdout, result.stderr
    assert int(result.stdout.split("fork refused after")[1].split()[0]) < 50
    if os.path.exists("/root/.bashrc"):  # noqa: ASYNC240 - one local stat, nothing else runs
        assert "read refused PermissionError" in result.stdout


async def test_tool_wraps_run_python():
    tool = PythonSandboxTool({"timeout_s": 2, "max_output_chars": 50})
    assert tool.name == "python"
    assert tool.limits.timeout_s == 2
    assert tool.timeout_s == 7.0
    iid = await tool.create()
    resp, reward, metrics = await tool.execute(iid, {"code": "print(1+1)\nraise ValueError('boom')"})
    assert resp.text.startswith("2\n[stderr]\n")
    assert resp.text.endswith("ValueError: boom\n")
    assert metrics["sandbox_returncode"] == 1
    assert reward == 0.0
    with pytest.raises(ValueError, match="unknown config keys"):
        PythonSandboxTool({"memory": 1})


async def test_new_limits_are_reachable_from_the_tool_yaml(tmp_path):
    from agentloop_tools.load_tools import load_tools_from_config

    config = tmp_path / "tools.yaml"
    config.write_text(
        "tools:\n"
        "  - class_name: agentloop_tools.builtin.sandbox.PythonSandboxTool\n"
        "    config: {type: native, timeout_s: 3, max_scratch_mb: 8, uid_range: [62000, 62009],\n"
        "             private_tmp: false, run_as_root: false}\n"
    )
    tool = load_tools_from_config(config)["python"]
    assert tool.limits.max_scratch_mb == 8
    assert tool.limits.uid_range == (62000, 62009)
    assert tool.limits.private_tmp is False
    assert tool.limits.run_as_root is False
    iid = await tool.create()
    resp, _, metrics = await tool.execute(iid, {"code": "print('hi')"})
    assert resp.text == "hi\n"
    assert metrics["sandbox_scratch_exceeded"] is False


@pytest.mark.parametrize(("config", "match"), [
    ({"uid_range": [5, 1]}, "uid_range must be"),
    ({"max_scratch_mb": 0}, "max_scratch_mb must be a positive number"),
    ({"user": "nobody", "run_as_root": True}, "either user .* or run_as_root"),
])
def test_bad_limits_name_the_key(config, match):
    with pytest.raises(ValueError, match=match):
        PythonSandboxTool(config)


@pytest.mark.skipif(os.geteuid() != 0, reason="the uid drop and the private tmpfs need root")
async def test_as_root_each_concurrent_run_gets_its_own_uid():
    code = "import os, time\nprint(os.getuid())\ntime.sleep(0.5)"
    results = await asyncio.gather(*(run_python(code, SandboxLimits(uid_range=(62100, 62103))) for _ in range(4)))
    uids = sorted(int(r.stdout) for r in results)
    assert uids == [62100, 62101, 62102, 62103], [r.stderr for r in results]
    assert all("dedicated-uid" in r.isolation for r in results)
    one, two = await asyncio.gather(*(run_python(code, SandboxLimits(uid_range=(62200, 62200))) for _ in range(2)),
                                    return_exceptions=True)
    refused = [r for r in (one, two) if isinstance(r, Exception)]
    assert len(refused) == 1
    assert "all 1 uids of uid_range 62200-62200 are in use" in str(refused[0])


@pytest.mark.skipif(os.geteuid() != 0, reason="run_as_root only means something when started as root")
async def test_run_as_root_opt_out_keeps_root():
    result = await run_python("import os; print(os.getuid())", SandboxLimits(run_as_root=True))
    assert result.stdout.strip() == "0"
    assert "dedicated-uid" not in result.isolation


async def test_a_cancelled_call_kills_the_run_and_removes_its_scratch():
    code = (
        "import os, time\n"
        "if os.fork() == 0:\n"
        "    os.setsid(); time.sleep(60); os._exit(0)\n"
        "print(os.getpid(), os.getcwd(), flush=True)\n"
        "time.sleep(60)\n"
    )
    before = set(os.listdir(tempfile.gettempdir()))
    task = asyncio.ensure_future(run_python(code, SandboxLimits(timeout_s=30)))
    await asyncio.sleep(1.0)  # the code has started (generously)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    left = [d for d in set(os.listdir(tempfile.gettempdir())) - before if d.startswith("agentloop-sandbox-")
            and d != "agentloop-sandbox-uids"]
    assert left == [], left
    marker_pids = [p for p in os.listdir("/proc") if p.isdigit() and _has_sandbox_marker(p)]
    assert marker_pids == [], "processes of the cancelled run outlived it"


def _has_sandbox_marker(pid: str) -> bool:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return any(v.startswith(b"AGENTLOOP_SANDBOX=") for v in f.read().split(b"\0"))
    except OSError:
        return False
