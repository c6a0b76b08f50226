"""Host memory of a CPU evaluation: resident set against what malloc holds in use, with glibc's
adaptive mmap threshold and with a fixed one (``trainer.host_mmap_threshold_mb``; issue 49 item
3: the real-model job under 8 GB).

One held-out evaluation of the real-model recipe (examples/trainer/smollm2_calculator.yaml:
``data.val_size`` problems, 128 rows decoding at a time, two turns with the calculator), on
``--model`` (default: SmolLM2-135M-Instruct from ``agentloop model fetch``; the recipe's SFT
checkpoint answers longer and so holds more), each setting in a fresh process:

- *peak RSS*: the process's resident set, sampled every 10 ms;
- *malloc in use*: the most glibc's ``mallinfo2`` counted in use (heap blocks plus mapped ones),
  sampled every 100 ms: the memory the evaluation needed;
- the difference is freed memory the heap kept (holes left by blocks whose sizes drift step by
  step).

Each setting is glibc's mmap threshold (``--thresholds``), with today's code or, with
``--baseline-tree DIR`` (a folder holding the packages' code before a change, put first on
``PYTHONPATH``), the code before; settings run in turn for ``--repeats`` rounds, and the table
gives medians. ``--engine-dtypes`` adds a setting per ``actor_rollout_ref.rollout.dtype`` value
(``model``, the recipe's, is bfloat16 on a CPU with AVX512_BF16 or AMX and float32 elsewhere).

    python bench/bench_host_memory.py [--model DIR] [--thresholds adaptive 8] [--baseline-tree DIR]
                                      [--engine-dtypes float32 model]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import REPO_ROOT, load_average, table, versions, write_result  # noqa: E402

RECIPE = REPO_ROOT / "examples" / "trainer" / "smollm2_calculator.yaml"

CHILD = r"""
import ctypes, gc, json, sys, threading, time
from agentloop_core.runtime.host_memory import map_large_blocks, release_host_memory
from agentloop_trainer.config.loading import load_config
from agentloop_trainer.stages.rollout_setup import evaluate_checkpoint

model, threshold, recipe, extra = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
if threshold != "adaptive":
    assert map_large_blocks(int(threshold) << 20)
libc = ctypes.CDLL("libc.so.6")
class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                "fsmblks", "uordblks", "fordblks", "keepcost")]
libc.mallinfo2.restype = Info
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * 4096 / 2**30
peak, in_use = [0.0], [0.0]
def sample():
    k = 0
    while True:
        peak[0] = max(peak[0], rss())
        if k % 10 == 0:
            info = libc.mallinfo2()
            in_use[0] = max(in_use[0], (info.uordblks + info.hblkhd) / 2**30)
        k += 1
        time.sleep(0.01)
cfg = load_config([f"model.path={model}", *extra], config_file=recipe)
release_host_memory()
start_rss = rss()
threading.Thread(target=sample, daemon=True).start()
t = time.perf_counter()
result = evaluate_checkpoint(cfg, model)
print(json.dumps({"seconds": time.perf_counter() - t, "peak_rss_gb": peak[0], "malloc_in_use_gb": in_use[0],
                  "start_rss_gb": start_rss, "accuracy": result.accuracy, "n": result.n}))
"""


def _key(code: str, threshold: str, dtype: str | None) -> str:
    return "/".join([code, threshold, *([dtype] if dtype else [])])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="checkpoint folder (default: the fetched SmolLM2-135M-Instruct)")
    parser.add_argument("--thresholds", nargs="+", default=["adaptive", "8"],
                        help="'adaptive' (glibc's default) or a fixed mmap threshold in MB (1-32)")
    parser.add_argument("--repeats", type=int, default=1, help="rounds over the settings")
    parser.add_argument("--override", nargs="*", default=[], help="extra config overrides, e.g. data.val_size=64")
    parser.add_argument("--engine-dtypes", nargs="+", default=[None],
                        help="values of actor_rollout_ref.rollout.dtype to compare (default: the recipe's)")
    parser.add_argument("--baseline-tree", help="a folder holding the packages' code before a change, put first on "
                        "PYTHONPATH for a 'before' run of each setting, alternating with today's code")
    args = parser.parse_args()
    model = args.model
    if model is None:
        from agentloop_trainer.pretrained import fetch_model

        model = str(fetch_model("smollm2-135m-instruct"))
    load_at_start = load_average()
    codes = ["before", "now"] if args.baseline_tree else ["now"]
    settings = [(code, t, d) for d in args.engine_dtypes for t in args.thresholds for code in codes]
    runs: dict[str, list[dict]] = {_key(*s): [] for s in settings}
    for r in range(args.repeats):
        for code, threshold, dtype in settings:
            key = _key(code, threshold, dtype)
            overrides = [*args.override, *([f"actor_rollout_ref.rollout.dtype={dtype}"] if dtype else [])]
            env = dict(os.environ)
            if code == "before":
                env["PYTHONPATH"] = os.pathsep.join(filter(None, [args.baseline_tree, env.get("PYTHONPATH")]))
            proc = subprocess.run([sys.executable, "-c", CHILD, model, threshold, str(RECIPE), json.dumps(overrides)],
                                  capture_output=True, text=True, cwd=REPO_ROOT, env=env)
            if proc.returncode:
                sys.exit(f"the evaluation ({key}) failed:\n{proc.stderr[-3000:]}")
            runs[key].append(json.loads(proc.stdout.strip().splitlines()[-1]))
            print(f"round {r + 1}/{args.repeats} {key}: {runs[key][-1]}", flush=True)
    rows = []
    first = next(iter(runs))
    base = statistics.median(x["seconds"] for x in runs[first])
    for (code, threshold, dtype), got in zip(settings, runs.values(), strict=True):
        med = {k: statistics.median(x[k] for x in got) for k in ("seconds", "peak_rss_gb", "malloc_in_use_gb")}
        rows.append([code, threshold if threshold == "adaptive" else f"{threshold} MB", dtype or "the recipe's",
                     round(med["peak_rss_gb"], 2),
                     round(med["malloc_in_use_gb"], 2), round(med["peak_rss_gb"] - med["malloc_in_use_gb"], 2),
                     round(med["seconds"], 1), round(med["seconds"] / base, 3), got[0]["accuracy"]])
    headers = ["code", "mmap threshold", "engine dtype", "peak RSS GB", "malloc in use GB", "kept by the heap GB", "eval s",
               f"vs {first}", "accuracy"]
    n = runs[first][0]["n"]
    title = f"one held-out evaluation of the real-model recipe on {Path(model).name} (n={n}), medians"
    table(headers, rows, title=title)
    write_result("host_memory", {"title": title, "headers": headers, "rows": rows, "runs": runs,
                                 "overrides": args.override, "engine_dtypes": args.engine_dtypes,
                                 "baseline_tree": args.baseline_tree,
                                 "load_average_at_start": load_at_start,
                                 "versions": versions("torch", "transformers")})


if __name__ == "__main__":
    main()
