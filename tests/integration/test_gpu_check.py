"""The GPU check (tools/gpu_check): its CPU-side logic, the part any machine can run.

Without CUDA, ``run.py`` must write its result file saying ``skipped`` with the reason and exit
0; the step runner must kill a step that outruns its budget (and what it started) and record it
as a ``timeout`` failure, and must run the next step after a failed one. On a machine lent a GPU
the check itself runs for real (README, "A GPU check in one command").
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

CHECK = Path(__file__).resolve().parents[2] / "tools" / "gpu_check"
sys.path.insert(0, str(CHECK))  # the check's modules import each other as siblings, as scripts do

from check_steps import (  # noqa: E402  # pyright: ignore[reportMissingImports]
    MAIN_JOB_OVERRIDES,
    REAL_MODEL_OVERRIDES,
    Plan,
    gpu_test_files,
    gpu_tests_step,
    junit_counts,
    real_model_step,
)
from step_runner import (  # noqa: E402  # pyright: ignore[reportMissingImports]
    MIN_STEP_S,
    Deadline,
    Step,
    kill_running,
    numbers_in,
    run_step,
    run_steps,
    running_groups,
)

STEP_NAMES = ["env", "install", "gpu_tests", "hf_vs_generate", "main_job", "real_model"]


def _python(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def _running(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie left for a reaper counts as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError):
        return False
    return state != "Z"


def test_without_cuda_the_check_writes_skipped_with_the_reason_and_exits_0(tmp_path):
    """No CUDA here: (a) records the machine, (b)-(f) are skipped with the probe's reason, the
    file under $OUT says ``skipped`` and the exit code is 0. Debug: the file's ``env`` step
    holds the probe's output tail."""
    torch = pytest.importorskip("torch", reason="the probe reads torch's versions (nox -s integration installs it)")
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: run.py would run the check for real (minutes), not skip")
    proc = subprocess.run([sys.executable, str(CHECK / "run.py")], env={**os.environ, "OUT": str(tmp_path)},
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads((tmp_path / "gpu_check.json").read_text())
    assert result["status"] == "skipped"
    assert "CUDA" in result["reason"], result["reason"]
    assert [s["name"] for s in result["steps"]] == STEP_NAMES
    env, *later = result["steps"]
    assert env["status"] == "pass", env
    assert env["numbers"]["cuda_available"] is False
    assert env["numbers"]["torch"] == torch.__version__
    assert {"agentloop-core", "agentloop-trainer"} <= set(env["numbers"]["packages"])
    assert [(s["status"], s["reason"]) for s in later] == [("skip", result["reason"])] * len(later)
    assert "gpu check: skipped" in proc.stdout


def test_a_step_over_its_budget_is_killed_with_its_children_and_recorded_as_a_timeout(tmp_path):
    """The step's whole process group goes (a trainer's ranks, a server's workers), not only
    the command the step started."""
    pid_file = tmp_path / "child.pid"
    code = (f"import subprocess, sys, time; child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); "
            f"open({str(pid_file)!r}, 'w').write(str(child.pid)); print('child started', flush=True); time.sleep(600)")
    result = run_step(Step("sleeper", "sleeps past its budget", _python(code), budget_s=3.0))
    assert result.status == "fail"
    assert str(result.reason).startswith("timeout after 3 s"), result.reason
    assert "child started" in result.tail
    child = int(pid_file.read_text())
    for _ in range(50):  # SIGKILL is delivered at once; the kernel may take a moment to tear it down
        if not _running(child):
            break
        time.sleep(0.1)
    assert not _running(child), f"the step's child {child} outlived the step's timeout"


def test_a_check_stopped_from_outside_takes_its_running_step_down():
    """run.py calls kill_running on SIGTERM: each step is a session of its own, so nothing else
    would stop it when the device call's timeout stops the check."""
    results = []
    step = Step("long", "", _python("import time; time.sleep(600)"), budget_s=300.0)
    worker = threading.Thread(target=lambda: results.append(run_step(step)))
    worker.start()
    for _ in range(300):
        if running_groups():
            break
        time.sleep(0.1)
    (group,) = running_groups()
    kill_running()
    worker.join(60)
    assert not worker.is_alive()
    assert (results[0].status, results[0].returncode) == ("fail", -9)
    assert not _running(group)
    assert not running_groups()


def test_a_failing_step_does_not_stop_the_next_one():
    seen = []
    steps = [
        Step("broken", "exits 3", _python("import sys; print('bad input', file=sys.stderr); sys.exit(3)")),
        Step("missing", "cannot start", ["/nonexistent/gpu-check-command"]),
        Step("fine", "reports numbers", _python("print('GPU_CHECK_NUMBERS {\"tokens_per_s\": 12.5}')")),
    ]
    results = run_steps(steps, Deadline(300.0), on_result=lambda r: seen.append(r.name))
    assert seen == ["broken", "missing", "fine"]
    broken, missing, fine = results
    assert (broken.status, broken.reason, broken.returncode) == ("fail", "exit code 3", 3)
    assert "bad input" in broken.tail
    assert missing.status == "fail"
    assert missing.reason is not None
    assert missing.reason.startswith("could not start")
    assert (fine.status, fine.numbers) == ("pass", {"tokens_per_s": 12.5})


def test_the_total_deadline_caps_each_budget_and_skips_a_step_it_leaves_no_time_for():
    deadline = Deadline(100.0, started=time.perf_counter() - 40.0)
    assert 59.0 < deadline.budget_for(Step("long", "", budget_s=1000.0)) <= 60.0
    assert deadline.budget_for(Step("short", "", budget_s=10.0)) == 10.0
    spent = Deadline(100.0, started=time.perf_counter() - 100.0 + MIN_STEP_S / 2)
    (result,) = run_steps([Step("late", "", _python("print('ran')"))], spent)
    assert result.status == "skip"
    assert result.reason is not None
    assert "not started" in result.reason


def test_a_broken_numbers_line_or_reader_is_reported_not_dropped():
    assert numbers_in("GPU_CHECK_NUMBERS {not json")["numbers_error"].startswith("unreadable")
    assert numbers_in('GPU_CHECK_NUMBERS {"a": 1}\nGPU_CHECK_NUMBERS {"a": 2}\n') == {"a": 2}

    def reader(_output: str) -> dict:
        raise KeyError("summary")

    result = run_step(Step("read", "", _python("print('hi')"), parse=reader))
    assert result.status == "pass"
    assert result.numbers == {"parse_error": "KeyError: 'summary'"}


def test_a_step_that_exits_0_still_fails_its_check():
    step = Step("counted", "", _python('print(\'GPU_CHECK_NUMBERS {"passed": 0}\')'),
                check=lambda n: None if n["passed"] else "nothing ran")
    result = run_step(step)
    assert (result.status, result.reason, result.returncode) == ("fail", "nothing ran", 0)


def test_on_cuda_every_gpu_test_skipping_fails_the_gpu_tests_step(tmp_path):
    """A CUDA machine where the gpu tests all skip (a missing extra, a broken import) has not
    checked anything: the step says so instead of passing."""
    check = gpu_tests_step(Plan(python=sys.executable, work=tmp_path, wheels=tmp_path)).check
    assert check is not None
    assert "no gpu-marked test ran on CUDA (4 skipped" in str(check({"passed": 0, "skipped": 4}))
    assert check({"passed": 1, "skipped": 3}) is None
    assert gpu_tests_step(Plan(python=sys.executable, work=tmp_path, wheels=tmp_path, device="cpu")).check is None


def test_the_real_model_step_says_why_it_is_skipped(tmp_path):
    plan = Plan(python=sys.executable, work=tmp_path, wheels=tmp_path)
    assert "64 MiB" in str(real_model_step(plan).skip)
    missing = Plan(python=sys.executable, work=tmp_path, wheels=tmp_path, model=tmp_path / "absent")
    assert "does not exist" in str(real_model_step(missing).skip)
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    step = real_model_step(Plan(python=sys.executable, work=tmp_path, wheels=tmp_path, model=gguf))
    assert step.skip is None
    script = step.argv[-1]
    assert script.index(" model convert ") < script.index(" data calculator-sft ") < script.index(" train --config ")
    assert "trainer.device=cuda" in script


def test_the_gpu_tests_step_collects_the_modules_holding_gpu_marked_tests():
    names = {p.name for p in gpu_test_files()}
    assert "test_hf_server.py" in names, names
    assert "test_hf_server_sampling.py" not in names  # a module with no gpu mark is not collected


def test_junit_counts_reads_pytest_s_report(tmp_path):
    (tmp_path / "test_two.py").write_text(
        "import pytest\n\ndef test_ok():\n    pass\n\ndef test_bad():\n    assert 1 == 2\n\n"
        "def test_skip():\n    pytest.skip('no GPU here')\n")
    xml = tmp_path / "report.xml"
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={xml}",
                    str(tmp_path / "test_two.py")], cwd=tmp_path, capture_output=True, timeout=120, check=False,
                   env={**os.environ, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"})
    counts = junit_counts(xml)
    assert {k: counts[k] for k in ("tests", "passed", "failures", "skipped")} == \
        {"tests": 3, "passed": 1, "failures": 1, "skipped": 1}
    assert counts["failed"] == ["test_two::test_bad"]
    assert "no GPU here" in counts["skip_reasons"][0]
    assert "was not written" in junit_counts(tmp_path / "absent.xml")["junit"]


def test_the_main_job_and_real_recipe_overrides_are_keys_the_trainer_knows(tmp_path, capsys):
    """A renamed config key would otherwise surface only on the device, costing its minutes."""
    main = pytest.importorskip("agentloop_trainer.cli", reason="needs agentloop-trainer (nox -s integration)").main
    assert main(["train", "--show-config", "trainer.device=cuda", *MAIN_JOB_OVERRIDES]) in (0, None)
    shown = capsys.readouterr().out
    assert "total_steps: 3" in shown
    assert "device: cuda" in shown
    recipe = CHECK.parents[1] / "examples" / "trainer" / "smollm2_calculator.yaml"
    assert main(["train", "--show-config", "--config", str(recipe), f"model.path={tmp_path}",
                 f"sft.train_files={tmp_path / 'sft.parquet'}", "trainer.device=cuda", *REAL_MODEL_OVERRIDES]) in (0, None)
    shown = capsys.readouterr().out
    assert "total_steps: 2" in shown
    assert "custom_chat_template: chatml-hermes" in shown


def test_every_carried_wheel_is_pinned_once():
    lines = [ln.strip() for ln in (CHECK / "wheels.txt").read_text().splitlines()
             if ln.strip() and not ln.startswith("#")]
    names = [ln.split("==")[0].lower().replace("_", "-") for ln in lines]
    assert all("==" in ln for ln in lines), lines
    assert len(names) == len(set(names)), "two versions of one wheel stop the whole install on the device"
    assert {"hatchling", "editables", "omegaconf", "pytest-asyncio", "pydantic", "pydantic-core"} <= set(names)
