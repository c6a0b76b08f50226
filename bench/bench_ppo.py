"""PPO with a critic (``algorithm.adv_estimator=gae``) against GRPO on the main job's task: the
calculator tool and arithmetic prompts, the built-in tiny model after its SFT warm-up (cached
in ``AGENTLOOP_CACHE_DIR`` after the first run), ``agentloop train`` with its defaults
(``data.train_batch_size=16`` x ``rollout.n=8``, actor lr 1e-4, 30 steps) and the held-out
accuracy (200 prompts, greedy) every ``--test-freq`` steps.

The PPO run changes only the estimator and adds the critic: ``critic.optim.lr``,
``trainer.critic_warmup``, ``algorithm.gamma``/``lam`` (verl's defaults 1/1 unless given) and
the same samples per step (GAE does not need groups; keeping ``rollout.n=8`` keeps the
comparison at equal samples). Both runs see the same prompts in the same order (same seed).

Run: ``python bench/bench_ppo.py`` (~6-10 min on 2 shared cores; ``--steps``, ``--seeds``,
``--critic-lr``, ``--critic-warmup``). Prints a table of reward and held-out accuracy per
step, writes ``bench/results/ppo_vs_grpo.json`` and ``docs/img/ppo_vs_grpo.png`` (matplotlib,
when installed). Not an assertion: a tiny model, few seeds, a shared machine.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import REPO_ROOT, agentloop_command, load_average, table, versions, write_result  # noqa: E402

PNG = REPO_ROOT / "docs" / "img" / "ppo_vs_grpo.png"


def overrides_for(name: str, args: argparse.Namespace) -> list[str]:
    """The ``agentloop train`` overrides of one algorithm (beyond the shared ones)."""
    if name == "grpo":
        return ["algorithm.adv_estimator=grpo"]
    return ["algorithm.adv_estimator=gae", f"critic.optim.lr={args.critic_lr}",
            f"trainer.critic_warmup={args.critic_warmup}", f"algorithm.gamma={args.gamma}", f"algorithm.lam={args.lam}"]


def run(out: Path, name: str, seed: int, args: argparse.Namespace) -> dict:
    """One ``agentloop train`` into ``out`` (a finished one there, with its ``summary.json``, is
    read instead of run again); returns its per-step reward, held-out accuracies and critic metrics."""
    cmd = [*agentloop_command(), "train", f"trainer.default_local_dir={out}", f"trainer.total_steps={args.steps}",
           f"trainer.test_freq={args.test_freq}", "trainer.save_freq=0", f"trainer.seed={seed}",
           "trainer.logger=[jsonl]", "trainer.progress_bar=false", *overrides_for(name, args)]
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    if not (out / "summary.json").is_file():
        with open(out.with_suffix(".log"), "w") as log:
            proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        if proc.returncode != 0:
            raise SystemExit(f"{name} seed {seed} failed (exit {proc.returncode}); see {out.with_suffix('.log')}")
    # The RL stage's own seconds (evaluations included; start-up and the cached SFT load excluded).
    wall = float(json.loads((out / "summary.json").read_text())["wall_seconds"])
    reward, evals, critic = {}, {}, {}
    for line in (out / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        step = int(record["step"])
        if "reward/mean" in record:
            reward[step] = float(record["reward/mean"])
        if "eval/accuracy" in record:
            evals[step] = float(record["eval/accuracy"])
        if "critic/vf_loss" in record:
            critic[step] = {k: float(v) for k, v in record.items() if k.startswith("critic/")}
    return {"reward": reward, "eval": evals, "critic": critic, "wall_s": wall}


def plot(results: dict[str, list[dict]], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    colours = {"grpo": "tab:blue", "ppo": "tab:red"}
    for name, runs in results.items():
        for i, r in enumerate(runs):
            label = f"{name}" + (f" (seed {i})" if len(runs) > 1 else "")
            left.plot(list(r["reward"]), list(r["reward"].values()), color=colours.get(name), alpha=0.8 - 0.3 * i,
                      label=label)
            right.plot(list(r["eval"]), list(r["eval"].values()), "o-", color=colours.get(name), alpha=0.8 - 0.3 * i,
                       label=label)
    left.set_title("train reward (mean over the step's samples)")
    right.set_title("held-out accuracy (200 prompts, greedy)")
    for ax in (left, right):
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("calculator task, tiny model after SFT: PPO (GAE + critic) vs GRPO", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--test-freq", type=int, default=5)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--critic-lr", type=float, default=1e-3)
    parser.add_argument("--critic-warmup", type=int, default=3)
    parser.add_argument("--gamma", type=float, default=1.0)
    parser.add_argument("--lam", type=float, default=1.0)
    parser.add_argument("--algorithms", nargs="+", default=["grpo", "ppo"], choices=["grpo", "ppo"])
    parser.add_argument("--work-dir", type=Path, default=None,
                        help="keep the runs (and their logs) here; finished runs found there are read, not rerun "
                             "(so runs started separately, e.g. in parallel, can be tabulated); default: a temp folder")
    args = parser.parse_args()
    load_start = load_average()
    results: dict[str, list[dict]] = {name: [] for name in args.algorithms}
    with tempfile.TemporaryDirectory(prefix="bench-ppo-") as tmp:
        work = args.work_dir or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        for seed in args.seeds:  # seeds outermost: a load swing on the shared machine hits both
            for name in args.algorithms:
                r = run(work / f"{name}-{seed}", name, seed, args)
                results[name].append(r)
                ev = list(r["eval"].values())
                print(f"{name} seed {seed}: held-out {ev[0]:.3f} -> {ev[-1]:.3f} in {r['wall_s']:.0f} s", flush=True)
    steps = sorted({s for runs in results.values() for r in runs for s in r["eval"]})
    rows = []
    for name, runs in results.items():
        for seed, r in zip(args.seeds, runs, strict=True):
            rewards = list(r["reward"].values())
            last = r["critic"].get(max(r["critic"], default=0), {})
            rows.append([name, seed, *(r["eval"].get(s, float("nan")) for s in steps),
                         sum(rewards[:5]) / max(len(rewards[:5]), 1), sum(rewards[-5:]) / max(len(rewards[-5:]), 1),
                         last.get("critic/vf_explained_var", float("nan")), r["wall_s"]])
    headers = ["algorithm", "seed", *(f"eval@{s}" for s in steps), "reward steps 1-5", "reward last 5",
               "critic explained var (last)", "RL wall s (shared machine)"]
    text = table(headers, rows, title="held-out accuracy per evaluation step, train reward, critic fit")
    per_step = [[name, seed, s, r["reward"][s], r["eval"].get(s, float("nan"))]
                for name, runs in results.items() for seed, r in zip(args.seeds, runs, strict=True)
                for s in sorted(r["reward"])]
    text_steps = table(["algorithm", "seed", "step", "train reward", "held-out accuracy"], per_step,
                       title="per step")
    plotted = plot(results, PNG)
    print(f"plot: {PNG}" if plotted else "plot: matplotlib is not installed", flush=True)
    write_result("ppo_vs_grpo", {
        "what": __doc__, "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}, "results": results, "table": text, "table_per_step": text_steps,
        "plot": str(PNG.relative_to(REPO_ROOT)) if plotted else None, "load_average_at_start": load_start,
        "versions": versions("torch", "transformers"),
    })


if __name__ == "__main__":
    main()
