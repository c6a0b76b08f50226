"""The GPU check: one command a session lent a GPU machine runs, under 8 minutes, writing one
result file.

    python3 tools/gpu_check/run.py [--model DIR_OR_GGUF] [--out FILE]    # on the device
    nox -s gpu-check                                                     # anywhere

Steps, each a subprocess with its own time budget (a step over it is killed and recorded as
failed with ``timeout``; a failing step never stops the later ones), all under ``TOTAL_S``:

(a) ``env``: GPU, torch / CUDA / transformers and our packages' versions;
(b) ``install``: the wheels prepare.sh downloaded, then our packages editable (no deps, no
    build isolation), into scratch folders: the device image's own packages stay as they are;
(c) ``gpu_tests``: the ``gpu``-marked tests of packages/*/tests (``nox -s gpu``);
(d) ``hf_vs_generate``: HFServer on CUDA against plain ``generate`` on the tiny model (greedy
    tokens equal, largest log-prob gap, tokens/s of each);
(e) ``main_job``: ``agentloop train`` (``nox -s train``) for 3 steps with trainer.device=cuda;
(f) ``real_model``: examples/trainer/smollm2_calculator.yaml for 2 steps on ``--model``
    (skipped, saying why, without one).

Without CUDA (``torch.cuda.is_available()`` False, or no torch) every step after (a) is skipped
with that reason, the file says ``"status": "skipped"`` and the exit code is 0. Otherwise the
exit code is 1 when a step failed. The file is ``--out``, else ``$OUT/gpu_check.json`` when
``$OUT`` is set (the device tool brings that folder back), else
outputs/gpu-check/gpu_check.json; it is rewritten after every step, so a check stopped from
outside still leaves the steps it finished (``"status": "stopped"`` on SIGTERM or Ctrl-C, which
also kill the running step; ``"running"`` after a SIGKILL).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script: its sibling modules

from check_steps import BUDGETS_S, ROOT, Plan, later_steps  # noqa: E402
from step_runner import Deadline, Step, StepResult, kill_running, run_step, run_steps  # noqa: E402

TOTAL_S = 450.0
"""The whole check's budget (7.5 minutes): under the 8 a device call is sized for, with room for
the interpreter's start and the result file, so a call with timeout_s=540 always returns it."""
RESULT_NAME = "gpu_check.json"


def result_path(explicit: Path | None = None) -> Path:
    if explicit is not None:
        return explicit
    if os.environ.get("OUT"):
        return Path(os.environ["OUT"]) / RESULT_NAME
    return ROOT / "outputs" / "gpu-check" / RESULT_NAME


def write_json(path: Path, data: dict[str, Any]) -> None:
    """Write ``data`` whole or not at all (a reader never sees half a file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    tmp.replace(path)


def overall(results: list[StepResult], skip_reason: str | None) -> tuple[str, str | None]:
    """The check's status and reason: ``skipped`` without CUDA, ``fail`` naming the failed
    steps, else ``pass``."""
    if skip_reason is not None:
        return "skipped", skip_reason
    failed = [r.name for r in results if r.status == "fail"]
    if failed:
        return "fail", f"failed steps: {', '.join(failed)}"
    return "pass", None


def env_step(python: str) -> Step:
    return Step("env", "(a) GPU, torch / CUDA / transformers and our packages' versions",
                [python, str(Path(__file__).resolve().parent / "probe_env.py")], BUDGETS_S["env"], cwd=ROOT)


def cuda_skip_reason(env: StepResult, device: str) -> str | None:
    """Why steps (b) to (f) do not run here, or None when they do."""
    if device != "cuda":
        return None  # a dry run of the check's logic on another device runs everything
    if env.status != "pass":
        return f"the environment probe failed ({env.reason}), so CUDA could not be confirmed"
    if env.numbers.get("cuda_available"):
        return None
    return str(env.numbers.get("cuda_reason") or "no CUDA GPU")


def check(plan: Plan, out: Path, total_s: float = TOTAL_S, only: set[str] | None = None) -> dict[str, Any]:
    """Run the whole check under ``total_s``, rewriting ``out`` after each step."""
    deadline = Deadline(total_s)
    record: dict[str, Any] = {
        "status": "running", "reason": None, "device": None,
        "started_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": [sys.executable, *sys.argv], "total_budget_s": total_s, "seconds": 0.0,
        "torch_device": plan.device, "work": str(plan.work), "steps": [],
    }
    results: list[StepResult] = []

    def keep(result: StepResult) -> None:
        results.append(result)
        record["steps"] = [r.as_dict() for r in results]
        record["seconds"] = round(total_s - deadline.left(), 2)
        write_json(out, record)

    probe = env_step(plan.python)
    env = run_step(probe, deadline.budget_for(probe))
    keep(env)
    record["device"] = env.numbers.get("gpu")
    skip = cuda_skip_reason(env, plan.device)
    steps = later_steps(plan)
    if only is not None:
        steps = [s if s.name in only else Step(s.name, s.title, budget_s=s.budget_s, skip="not selected (--steps)")
                 for s in steps]
    if skip is not None:
        steps = [Step(s.name, s.title, budget_s=s.budget_s, skip=skip) for s in steps]
    try:
        run_steps(steps, deadline, on_result=keep)
    except SystemExit:  # _stop: SIGTERM or Ctrl-C
        done = {r.name for r in results}
        running = next((s.name for s in steps if s.name not in done), "none")
        record.update(status="stopped", reason=f"stopped from outside while step {running!r} ran",
                      seconds=round(total_s - deadline.left(), 2))
        write_json(out, record)
        raise
    record["status"], record["reason"] = overall(results, skip)
    record["seconds"] = round(total_s - deadline.left(), 2)
    write_json(out, record)
    return record


def _stop(signum: int, _frame: object) -> None:
    """Stopped from outside (``timeout``, Ctrl-C): take the running step down with the check;
    the result file keeps every step finished before."""
    kill_running()
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=str(__doc__).splitlines()[0])
    parser.add_argument("--model", type=Path, default=None,
                        help="a real checkpoint for step (f): a converted Hugging Face folder or a GGUF file")
    parser.add_argument("--out", type=Path, default=None,
                        help=f"the result file (default: $OUT/{RESULT_NAME}, else outputs/gpu-check/{RESULT_NAME})")
    parser.add_argument("--wheels", type=Path, default=ROOT / ".whl" / "gpu-check",
                        help="the carried wheels (default: .whl/gpu-check, where prepare.sh puts them)")
    parser.add_argument("--work", type=Path, default=None, help="scratch folder (default: a new temporary one)")
    parser.add_argument("--device", default="cuda",
                        help="torch device of steps (d)-(f); 'cpu' is a slow dry run of the check's own logic")
    parser.add_argument("--steps", default=None, help="comma-separated names of the steps (b)-(f) to run (default: all)")
    parser.add_argument("--total-s", type=float, default=TOTAL_S, help=f"the whole check's budget (default {TOTAL_S:.0f})")
    args = parser.parse_args(argv)
    work = args.work or Path(tempfile.mkdtemp(prefix="gpu-check-"))
    work.mkdir(parents=True, exist_ok=True)
    plan = Plan(python=sys.executable, work=work.resolve(), wheels=args.wheels.resolve(), device=args.device,
                model=args.model.resolve() if args.model else None)
    out = result_path(args.out)
    only = set(args.steps.split(",")) if args.steps else None
    start = time.perf_counter()
    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    record = check(plan, out, args.total_s, only)
    if record["status"] == "skipped" and args.work is None:
        shutil.rmtree(work, ignore_errors=True)  # nothing ran in it
    print(f"gpu check: {record['status']}" + (f" ({record['reason']})" if record["reason"] else "")
          + f" in {time.perf_counter() - start:.0f} s; result: {out}")
    for step in record["steps"]:
        print(f"  {step['name']:<15} {step['status']:<5} {step['seconds']:>7.1f} s  {step['reason'] or ''}")
    return 1 if record["status"] == "fail" else 0


if __name__ == "__main__":
    sys.exit(main())
