"""Benchmark 20.1: the main job, ``agentloop train`` with no arguments, from a cold cache.

Runs the command a user runs (the same task, held-out set, loop and tool) in a subprocess
with ``AGENTLOOP_CACHE_DIR`` pointing at an empty folder, so the tokenizer, the tiny model and
the SFT warm-up are all built as on a fresh machine. Reports the wall time of the whole
command and of its parts (SFT warm-up from ``sft_info.json``, GRPO from ``summary.json``), the
held-out accuracy before and after, and the load average.

Run: ``python bench/bench_main_job.py`` (writes ``bench/results/main_job.json``); extra
arguments after ``--`` go to ``agentloop train`` (e.g. ``-- trainer.total_steps=10``).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import load_average, run_agentloop_train, table, versions, write_result  # noqa: E402

GOAL_SECONDS = 360.0
GOAL_GAIN_POINTS = 15.0


def run_cold(overrides: list[str], keep: bool) -> dict:
    """One cold run of ``agentloop train``; the numbers it reports plus its wall time."""
    work = Path(tempfile.mkdtemp(prefix="agentloop-main-job-"))
    summary, wall = run_agentloop_train(work / "run", overrides, env={"AGENTLOOP_CACHE_DIR": str(work / "cache")})
    sft_info = json.loads(next((work / "cache").glob("sft-*/sft_info.json")).read_text())
    if not keep:
        shutil.rmtree(work, ignore_errors=True)
    before, after = summary["eval_accuracy_before"], summary["eval_accuracy_after"]
    return {
        "wall_seconds": round(wall, 1),
        "sft_seconds": round(sft_info["seconds"], 1),
        "sft_steps": sft_info["steps"],
        "grpo_seconds": round(summary["wall_seconds"], 1),
        "grpo_steps": summary["steps"],
        "other_seconds": round(wall - sft_info["seconds"] - summary["wall_seconds"], 1),
        "accuracy_before": before,
        "accuracy_after": after,
        "gain_points": round(100 * (after - before), 1),
        "held_out_size": summary["held_out_size"],
        "per_template_before": summary.get("per_template_before"),
        "per_template_after": summary.get("per_template_after"),
        "work_dir": str(work) if keep else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--keep", action="store_true", help="keep the cache and run folder")
    parser.add_argument("overrides", nargs="*", help="key=value overrides for agentloop train (after --)")
    args = parser.parse_args()
    load_start = load_average()
    r = run_cold(args.overrides, args.keep)
    met = r["wall_seconds"] < GOAL_SECONDS and r["gain_points"] >= GOAL_GAIN_POINTS
    rows = [[f"{r['wall_seconds']:.0f}", f"{r['sft_seconds']:.0f} ({r['sft_steps']} steps)",
             f"{r['grpo_seconds']:.0f} ({r['grpo_steps']} steps)", f"{r['other_seconds']:.0f}",
             f"{100 * r['accuracy_before']:.1f}% -> {100 * r['accuracy_after']:.1f}% (n={r['held_out_size']})",
             f"{r['gain_points']:+.1f}"]]
    text = table(["whole command s", "SFT warm-up s", "GRPO s (evals included)", "other s (start-up, model, data)",
                  "held-out accuracy", "gain (points)"], rows,
                 title=f"Main job, cold cache, `agentloop train` with no arguments: goal < {GOAL_SECONDS:.0f} s "
                       f"and >= {GOAL_GAIN_POINTS:.0f} points: {'met' if met else 'missed'}")
    write_result("main_job", {
        "description": "agentloop train with no arguments (plus the given overrides) from an empty "
                       "AGENTLOOP_CACHE_DIR: tokenizer, tiny model and SFT warm-up built in the run",
        "overrides": args.overrides, "load_average_at_start": load_start, "load_average_at_end": load_average(),
        "versions": versions("torch", "transformers", "agentloop-trainer"),
        "result": r, "goal": {"seconds": GOAL_SECONDS, "gain_points": GOAL_GAIN_POINTS, "met": met},
        "table_markdown": text,
    })


if __name__ == "__main__":
    main()
