"""Credit per turn on a multi-step environment: held-out score vs samples seen, one advantage
per trajectory (``algorithm.turn_credit=trajectory``) against per-turn credit (``discounted``,
``turn_group``, ``step_group``), 3 seeds each.

The task is ``number_guess`` (``agentloop_trainer.task.number_guess``) made small enough for a
tiny model on 2 CPU cores: a secret from 1 to 8, at most 4 guesses, "Higher." / "Lower." after
each; step rewards 1.0 for the right guess, -0.1 for a wasted one (out of the range the feedback
allows, or no number). The policy is the default job's tiny model after its SFT warm-up (the
calculator demonstrations: it has never seen this game), so what it learns here is RL's.
Every run: 256 training rows, ``data.train_batch_size=4`` x ``rollout.n=4`` = 16 trajectories a
step, ``--steps`` steps (default 100), the held-out score every 10 steps: ``eval/accuracy``, the
trainer's greedy held-out *mean reward* over 64 games (the accuracy for 0/1 rewards; here 1.0 is
a solve at the first guess, each wasted guess costs 0.1, an unsolved game scores <= 0, so it
rises with the solve rate and with fewer wasted guesses; the trainer does not log the solve rate
of held-out games on its own); the per-turn modes use
``algorithm.turn_gamma=0.95`` (GiGPO's). Seeds (``trainer.seed``) change the data order and the
sampling; the starting checkpoint is the same for every run.

Run: ``python bench/bench_turn_credit.py`` (~10-15 min on 2 cores; ``--steps``, ``--seeds``,
``--modes`` to shorten). Prints a table and writes ``bench/results/turn_credit.json`` and
``bench/results/turn_credit.png`` (matplotlib, when installed). Not an assertion: a few seeds of
a tiny model, on a shared machine; read the spread across seeds before the means.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import RESULTS_DIR, agentloop_command, load_average, table, versions, write_result  # noqa: E402

MODES = ("trajectory", "discounted", "turn_group", "step_group")
SAMPLES_PER_STEP = 16  # data.train_batch_size x rollout.n below


def write_data(folder: Path) -> None:
    import pandas as pd

    from agentloop_trainer.task.number_guess import number_guess_rows

    folder.mkdir(parents=True, exist_ok=True)
    pd.DataFrame(number_guess_rows(256, 0, "train", 1, 8)).to_parquet(folder / "train.parquet")
    pd.DataFrame(number_guess_rows(64, 1, "test", 1, 8)).to_parquet(folder / "val.parquet")


def run(data: Path, out: Path, mode: str, seed: int, steps: int) -> tuple[list[tuple[int, float]], float]:
    """One ``agentloop train``; returns ``[(samples seen, held-out score)]`` and its wall seconds."""
    overrides = [
        f"data.train_files={data / 'train.parquet'}", f"data.val_files={data / 'val.parquet'}",
        "data.train_batch_size=4", "actor_rollout_ref.rollout.n=4", "data.max_response_length=96",
        "actor_rollout_ref.rollout.agent.loops.env_agent.environment_kwargs.max_guesses=4",
        "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=4",
        f"trainer.total_steps={steps}", "trainer.test_freq=10", "trainer.save_freq=0", f"trainer.seed={seed}",
        "trainer.logger=[jsonl]", "trainer.progress_bar=false", f"trainer.default_local_dir={out}",
        f"algorithm.turn_credit={mode}", f"algorithm.turn_gamma={1.0 if mode == 'trajectory' else 0.95}",
    ]
    # One thread per run: the machine is shared; every run gets the same budget.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
    start = time.perf_counter()
    with open(out.with_suffix(".log"), "w") as log:
        proc = subprocess.run([*agentloop_command(), "train", *overrides], env=env, stdout=log, stderr=subprocess.STDOUT)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"{mode} seed {seed} failed (exit {proc.returncode}); see {out.with_suffix('.log')}")
    curve = []
    for line in (out / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if "eval/accuracy" in record:
            curve.append((int(record["step"]) * SAMPLES_PER_STEP, float(record["eval/accuracy"])))
    return sorted(dict(curve).items()), wall


def plot(curves: dict[str, list[list[tuple[int, float]]]], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for mode, runs in curves.items():
        xs = [x for x, _ in runs[0]]
        ys = [[dict(r).get(x, float("nan")) for r in runs] for x in xs]
        ax.plot(xs, [statistics.fmean(y) for y in ys], marker="o", label=f"{mode} (mean of {len(runs)})")
        ax.fill_between(xs, [min(y) for y in ys], [max(y) for y in ys], alpha=0.15)
    ax.set_xlabel("training trajectories seen")
    ax.set_ylabel("held-out score (greedy mean reward, 64 games)")
    ax.set_title("number_guess 1-8, 4 guesses: trajectory vs per-turn credit (band: min-max over seeds)")
    ax.title.set_fontsize(9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    args = parser.parse_args()
    load_start = load_average()
    curves: dict[str, list[list[tuple[int, float]]]] = {m: [] for m in args.modes}
    walls: dict[str, list[float]] = {m: [] for m in args.modes}
    with tempfile.TemporaryDirectory(prefix="bench-turn-credit-") as tmp:
        data = Path(tmp) / "data"
        write_data(data)
        # Seeds outermost, modes alternating: a load swing on the shared machine hits every mode.
        for seed in args.seeds:
            for mode in args.modes:
                curve, wall = run(data, Path(tmp) / f"{mode}-{seed}", mode, seed, args.steps)
                curves[mode].append(curve)
                walls[mode].append(wall)
                print(f"{mode} seed {seed}: {curve[0][1]:.3f} -> {curve[-1][1]:.3f} in {wall:.0f} s", flush=True)
    xs = [x for x, _ in next(iter(curves.values()))[0]]
    marks = [x for x in xs if x][:: max(1, len(xs) // 5)] + ([xs[-1]] if xs[-1] not in xs[:: max(1, len(xs) // 5)] else [])
    rows = []
    for mode, runs in curves.items():
        final = [r[-1][1] for r in runs]
        area = [statistics.fmean(y for _, y in r[1:]) for r in runs]
        rows.append([mode, *(statistics.fmean(dict(r)[x] for r in runs) for x in marks),
                     f"{statistics.fmean(final):.3f} ± {statistics.pstdev(final):.3f}",
                     " / ".join(f"{v:.2f}" for v in final), statistics.fmean(area), statistics.fmean(walls[mode])])
    headers = ["turn_credit", *(f"@{x}" for x in marks), "final (mean ± sd)", "final per seed",
               "mean over evals", "wall s / run"]
    text = table(headers, rows, title=f"held-out score (greedy mean reward) vs trajectories seen (start {curves[args.modes[0]][0][0][1]:.3f})")
    png = RESULTS_DIR / "turn_credit.png"
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    plotted = plot(curves, png)
    print(f"plot: {png}" if plotted else "plot: matplotlib is not installed", flush=True)
    write_result("turn_credit", {
        "what": __doc__, "steps": args.steps, "seeds": args.seeds, "samples_per_step": SAMPLES_PER_STEP,
        "curves": curves, "wall_s": walls, "table": text, "plot": str(png) if plotted else None,
        "load_average_at_start": load_start, "versions": versions("torch", "transformers"),
    })


if __name__ == "__main__":
    main()
