"""The tiny SFT warm-up under its two learning-rate schedules: steps until learned, seconds,
final loss, per seed and thread count.

``cosine_restarts`` (750-step cosine schedules, repeated while not learned, up to 1500 steps)
against ``wsd`` (peak rate until the loss leaves its plateau, then a 200-step cooldown, stopping
once learned): see ``agentloop_trainer.policy.lr_schedules``. When the loss leaves its plateau is
chaotic (seed, thread count, float rounding), so each seed runs with 1 thread and, as a second
rounding of the same seed, with 2 threads (``torch.set_num_threads(2)``: another reduction order;
only the 1-thread rows are timings when the script is pinned to one core).

Each run is its own process (``--one``), so threads and memory start clean; ``--runs-dir DIR``
keeps each run's result (and, with ``--save``, its checkpoint) there and reuses a finished one;
``--no-run`` only tabulates the runs already there.

Run: ``taskset -c 1 python bench/bench_warmup_schedule.py --seeds 0 1 2 3 --threads 1 2``
(2-3 h on one core: 0.45-0.65 s a step, 524-1500 steps a run). Prints a table, writes
``bench/results/warmup_schedule.json``. Not an assertion: a tiny model on a shared machine.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import REPO_ROOT, load_average, table, versions, write_result  # noqa: E402

from agentloop_trainer.policy.lr_schedules import SCHEDULES as SCHEDULE_REGISTRY  # noqa: E402

SCHEDULES = tuple(SCHEDULE_REGISTRY)


def one(schedule: str, seed: int, threads: int, save: Path | None) -> dict:
    """Run one warm-up in this process and return its numbers."""
    import torch

    from agentloop_core.testing import load_tiny_tokenizer
    from agentloop_trainer.policy.lr_schedules import EXIT_WINDOW
    from agentloop_trainer.policy.model import build_tiny_policy
    from agentloop_trainer.policy.settings import SFTSection
    from agentloop_trainer.stages.sft import STOP_WINDOW, learned, train_sft, window_mean
    from agentloop_trainer.task.calculator import BIASED_TEMPLATES, make_problems

    torch.set_num_threads(threads)
    tokenizer = load_tiny_tokenizer()
    config = SFTSection(schedule=schedule, seed=seed)
    model = build_tiny_policy(tokenizer, seed=seed)
    problems = make_problems(20000, 1)  # the default job's data.train_size and data.train_seed
    start = time.perf_counter()
    losses = train_sft(model, tokenizer, problems, config, tuple(BIASED_TEMPLATES))
    seconds = time.perf_counter() - start
    exit_step = next((k + 1 for k in range(len(losses))
                      if k + 1 >= config.warmup_steps and window_mean(losses[:k + 1], EXIT_WINDOW) < config.exit_loss),
                     None)
    if save is not None:
        model.save_pretrained(save)
        tokenizer.save_pretrained(save)
    return {"schedule": schedule, "seed": seed, "threads": threads, "steps": len(losses),
            "seconds": round(seconds, 1), "seconds_per_step": round(seconds / len(losses), 4),
            "final_loss": round(window_mean(losses), 5), "learned": learned(losses, config.stop_loss),
            "plateau_exit_step": exit_step, "stop_window": STOP_WINDOW, "losses": [round(x, 5) for x in losses]}


def main() -> None:
    """Run the grid (or one cell with ``--one``), print the table, write the result."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--schedules", nargs="+", default=list(SCHEDULES), choices=SCHEDULES)
    parser.add_argument("--runs-dir", type=Path, default=REPO_ROOT / "outputs" / "bench_warmup_schedule")
    parser.add_argument("--save", action="store_true", help="keep each run's checkpoint in the runs dir")
    parser.add_argument("--no-run", action="store_true", help="only report the runs already in the runs dir")
    parser.add_argument("--one", nargs=3, metavar=("SCHEDULE", "SEED", "THREADS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        schedule, seed, threads = args.one[0], int(args.one[1]), int(args.one[2])
        name = f"{schedule}_s{seed}_t{threads}"
        save = args.runs_dir / f"ck_{name}" if args.save else None
        result = one(schedule, seed, threads, save)
        (args.runs_dir / f"{name}.json").write_text(json.dumps(result))
        return

    args.runs_dir.mkdir(parents=True, exist_ok=True)
    runs = []
    for threads in args.threads:
        for seed in args.seeds:
            for schedule in args.schedules:
                path = args.runs_dir / f"{schedule}_s{seed}_t{threads}.json"
                if not path.exists() and args.no_run:
                    continue
                if not path.exists():
                    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
                    cmd = [sys.executable, __file__, "--runs-dir", str(args.runs_dir), "--one", schedule, str(seed),
                           str(threads)] + (["--save"] if args.save else [])
                    subprocess.run(cmd, env=env, check=True)
                runs.append(json.loads(path.read_text()))
                r = runs[-1]
                print(f"{schedule} seed {seed} threads {threads}: {r['steps']} steps {r['seconds']} s "
                      f"final {r['final_loss']}", flush=True)
    table(["schedule", "seed", "threads", "plateau exit", "steps", "seconds", "s/step", "final loss", "learned"],
          [[r["schedule"], r["seed"], r["threads"], r["plateau_exit_step"], r["steps"], r["seconds"],
            r["seconds_per_step"], r["final_loss"], r["learned"]] for r in runs],
          title="SFT warm-up: cosine_restarts vs wsd")
    write_result("warmup_schedule", {
        "description": "Tiny SFT warm-up (default sft section, data.train_size=20000) under sft.schedule "
                       "cosine_restarts and wsd; steps until learned (mean loss of the last 50 steps < "
                       "sft.stop_loss) or max_steps; seconds are wall time of train_sft only.",
        "runs": [{k: v for k, v in r.items() if k != "losses"} for r in runs],
        "loss_curves_mean50": {f"{r['schedule']}_s{r['seed']}_t{r['threads']}":
                               [round(sum(r["losses"][i:i + 50]) / len(r["losses"][i:i + 50]), 4)
                                for i in range(0, len(r["losses"]), 50)] for r in runs},
        "versions": versions("torch", "transformers"),
        "load_average_end": load_average(),
    })


if __name__ == "__main__":
    main()
