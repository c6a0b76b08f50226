"""The Python sandbox: limits on time, memory, processes and output; clean env; no leftovers."""

import os
import shutil
import time

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
    assert out[0] == "42" and result.returncode == 0 and not result.timed_out
    assert "agentloop-sandbox-" in out[1] and out[2] == "['main.py']"
    assert not os.path.exists(out[1])  # removed afterwards


async def test_infinite_loop_is_killed():
    start = time.monotonic()
    result = await run_python("while True: pass", SandboxLimits(timeout_s=1.0))
    assert result.timed_out and result.returncode == -9
    assert time.monotonic() - start < 5
    assert "killed after 1 s" in result.stderr


async def test_memory_hog_gets_memory_error():
    result = await run_python("x = bytearray(2 * 1024**3)\nprint('allocated')", SandboxLimits(memory_mb=256))
    assert "MemoryError" in result.stderr and "allocated" not in result.stdout
    assert result.returncode != 0


async def test_parent_env_vars_not_visible(monkeypatch):
    monkeypatch.setenv("AGENTLOOP_TEST_SECRET", "s3cr3t-value")
    result = await run_python("import os; print(sorted(os.environ)); print(open('/proc/self/environ').read())")
    assert "s3cr3t-value" not in result.stdout and "AGENTLOOP_TEST_SECRET" not in result.stdout
    assert result.returncode == 0


async def test_output_truncated():
    result = await run_python("print('a' * 100000)\nimport sys; sys.stderr.write('e' * 50000)", SandboxLimits(max_output_chars=100))
    assert result.truncated
    assert result.stdout.startswith("a" * 100) and "output truncated to 100 characters" in result.stdout
    assert result.stderr.endswith("e" * 100)  # stderr keeps its tail, where a traceback's error is
    assert len(result.stdout) < 200 and len(result.stderr) < 200


async def test_no_leftover_processes():
    code = (
        "import os, sys, time\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    time.sleep(1000)\n"
        "print(pid, flush=True)\n"
    )
    start = time.monotonic()
    result = await run_python(code, SandboxLimits(timeout_s=10))
    child = int(result.stdout.split()[0])
    # The main process exiting ends the run; it does not wait out the timeout for the child.
    assert time.monotonic() - start < 5 and not result.timed_out
    for _ in range(50):
        if not _alive(child):
            break
        time.sleep(0.05)
    assert not _alive(child), f"child {child} survived the sandbox run"


@pytest.mark.skipif(os.geteuid() != 0, reason="dropping to another user needs root")
@pytest.mark.skipif(not shutil.which("python3", path="/usr/bin"), reason="needs /usr/bin/python3, executable by 'nobody'")
async def test_process_limit_and_file_permissions_with_unprivileged_user():
    # As root RLIMIT_NPROC is ignored by the kernel; it applies once we drop to 'nobody'.
    limits = SandboxLimits(user="nobody", python_executable="/usr/bin/python3", max_processes=8, timeout_s=5)
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
    if os.path.exists("/root/.bashrc"):
        assert "read refused PermissionError" in result.stdout


async def test_tool_wraps_run_python():
    tool = PythonSandboxTool({"timeout_s": 2, "max_output_chars": 50})
    assert tool.name == "python" and tool.limits.timeout_s == 2 and tool.timeout_s == 7.0
    iid = await tool.create()
    resp, reward, metrics = await tool.execute(iid, {"code": "print(1+1)\nraise ValueError('boom')"})
    assert resp.text.startswith("2\n[stderr]\n") and resp.text.endswith("ValueError: boom\n")
    assert metrics["sandbox_returncode"] == 1 and reward == 0.0
    with pytest.raises(ValueError, match="unknown config keys"):
        PythonSandboxTool({"memory": 1})
