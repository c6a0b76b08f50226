"""On-policy distillation on the calculator task: a weak student learns from a better teacher
with the same tokenizer, held-out accuracy per step against the teacher's.

The teacher is the default job's SFT warm-up checkpoint (``sft.steps=750``, the job's starting
point); the student is the same tiny model after a shorter warm-up (``--student-sft-steps``,
default 250 steps of the same schedule). Both come from
``stages.sft.warmup_checkpoint.sft_checkpoint`` (cached in ~/.cache/agentloop), so they share the
tiny tokenizer. Runs of ``agentloop train`` from the student (:func:`variants`): pure
distillation (``distillation.enabled=true``, ``use_task_rewards=false``: the advantage of each
generated token is ``-(log p_student - log p_teacher)``, rewards are only logged) without a
baseline (``baseline=none``, verl's signal and the default) at the default job's RL learning
rate (1e-4) and at 3e-4, with the batch-mean baseline (``baseline=mean``) at 5e-5, 1e-4 and
3e-4, and whitened (``baseline=whiten``) at 1e-4; distillation added to the task's GRPO
advantage (``use_task_rewards=true``); and GRPO alone, the control. Each:
``data.train_batch_size=8`` x ``rollout.n=4`` = 32 trajectories a step, ``--steps`` steps,
held-out accuracy (greedy, 100 problems) every 5 steps. The teacher is evaluated on the same
100 problems.

Run: ``python bench/bench_distill.py`` (~80 min on 2 shared cores, or ~12 min with the
runs started side by side and this script pointed at them). ``--runs-dir DIR`` keeps the runs
there and reuses any run folder that already has a ``summary.json``; ``--only FOLDER ...`` runs
those variants and takes the others from the last ``bench/results/distill.json`` (the runs
before the ``baseline`` key existed are its ``none``). Prints a table, writes
``bench/results/distill.json`` and ``docs/img/distill.png`` (matplotlib, when installed). Not
an assertion: one seed of a tiny model on a shared machine.
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

from _common import REPO_ROOT, agentloop_command, load_average, table, versions, write_result  # noqa: E402

PNG = REPO_ROOT / "docs" / "img" / "distill.png"
COMMON = ["trainer.save_freq=0", "trainer.progress_bar=false", "data.val_size=100", "data.train_batch_size=8",
          "actor_rollout_ref.rollout.n=4", "trainer.logger=[jsonl]"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}


def warmup_checkpoint(steps: int | None) -> Path:
    """The SFT warm-up checkpoint after ``steps`` (None: the default job's schedule)."""
    from agentloop_trainer.config.loading import load_config
    from agentloop_trainer.policy.tokenizer import load_tokenizer
    from agentloop_trainer.stages.sft.warmup_checkpoint import sft_checkpoint

    overrides = [] if steps is None else [f"sft.steps={steps}", "sft.stop_loss=null"]
    cfg = load_config([*overrides, "trainer.progress_bar=false"])
    return sft_checkpoint(cfg, load_tokenizer(cfg.model))


def train(run_dir: Path, overrides: list[str]) -> list[dict]:
    """``agentloop train`` into ``run_dir`` (reused when it finished before); its metrics lines."""
    if not (run_dir / "summary.json").exists():
        run_dir.parent.mkdir(parents=True, exist_ok=True)
        with open(run_dir.with_suffix(".log"), "w") as log:
            proc = subprocess.run([*agentloop_command(), "train", f"trainer.run_dir={run_dir}", *COMMON, *overrides],
                                  env=ENV, stdout=log, stderr=subprocess.STDOUT)
        if proc.returncode != 0:
            raise SystemExit(f"{run_dir.name} failed (exit {proc.returncode}); see {run_dir.with_suffix('.log')}")
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def curve(metrics: list[dict]) -> list[tuple[int, float]]:
    """``[(step, held-out accuracy)]``, the last evaluation of each step."""
    return sorted({int(m["step"]): float(m["eval/accuracy"]) for m in metrics if "eval/accuracy" in m}.items())


def kl_curve(metrics: list[dict]) -> list[tuple[int, float]]:
    return [(int(m["step"]), float(m["distill/reverse_kl"])) for m in metrics if "distill/reverse_kl" in m]


def plot(runs: dict[str, dict], teacher: float, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, (acc, kl) = plt.subplots(1, 2, figsize=(10, 4))
    for name, run in runs.items():
        xs, ys = zip(*run["accuracy"], strict=True)
        acc.plot(xs, ys, marker="o", label=f"student, {name}")
        if run["reverse_kl"]:
            kxs, kys = zip(*run["reverse_kl"], strict=True)
            kl.plot(kxs, kys, label=name, alpha=0.8)
    acc.axhline(teacher, color="k", linestyle="--", label=f"teacher ({teacher:.2f})")
    acc.set_xlabel("step (32 trajectories each)")
    acc.set_ylabel("held-out accuracy (greedy, 100 problems)")
    acc.set_title("student accuracy during on-policy distillation", fontsize=9)
    acc.legend(fontsize=7, loc="lower left")
    acc.grid(alpha=0.3)
    kl.set_xlabel("step")
    kl.set_ylabel("distill/reverse_kl (nats per generated token)")
    kl.set_title("reverse KL to the teacher on the student's own tokens", fontsize=9)
    kl.legend(fontsize=8)
    kl.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return True


def variants(student: Path, teacher: Path, steps: int) -> dict[str, tuple[str, list[str]]]:
    """Run name -> (folder, overrides): pure distillation without and with a baseline at two
    learning rates, distillation added to the task's GRPO advantage, and GRPO alone (the
    control: the same student, no teacher)."""
    base = [f"model.path={student}", f"trainer.total_steps={steps}", "trainer.test_freq=5"]
    teach = ["distillation.enabled=true", f"distillation.teacher_model.model_path={teacher}"]
    none, key = "distillation.distillation_loss.baseline=none", "distillation.distillation_loss.baseline"
    return {
        "distill, lr=1e-4": ("distill_lr1e-4", [*base, *teach, none, "actor_rollout_ref.actor.lr=1e-4"]),
        "distill, lr=3e-4": ("distill_lr3e-4", [*base, *teach, none, "actor_rollout_ref.actor.lr=3e-4"]),
        "distill + task reward, lr=1e-4": ("distill_task_lr1e-4", [
            *base, *teach, none, "actor_rollout_ref.actor.lr=1e-4",
            "distillation.distillation_loss.use_task_rewards=true"]),
        "GRPO only (no teacher), lr=1e-4": ("grpo_lr1e-4", [*base, "actor_rollout_ref.actor.lr=1e-4"]),
        "distill, baseline=mean, lr=1e-4": ("distill_mean_lr1e-4", [
            *base, *teach, f"{key}=mean", "actor_rollout_ref.actor.lr=1e-4"]),
        "distill, baseline=mean, lr=3e-4": ("distill_mean_lr3e-4", [
            *base, *teach, f"{key}=mean", "actor_rollout_ref.actor.lr=3e-4"]),
        "distill, baseline=whiten, lr=1e-4": ("distill_whiten_lr1e-4", [
            *base, *teach, f"{key}=whiten", "actor_rollout_ref.actor.lr=1e-4"]),
        "distill, baseline=mean, lr=5e-5": ("distill_mean_lr5e-5", [
            *base, *teach, f"{key}=mean", "actor_rollout_ref.actor.lr=5e-5"]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--student-sft-steps", type=int, default=250)
    parser.add_argument("--runs-dir", type=Path, default=Path("outputs") / "bench-distill")
    parser.add_argument("--only", nargs="+", metavar="FOLDER",
                        help="run these variants (their folder names); take the rest from the last results file")
    args = parser.parse_args()
    last = REPO_ROOT / "bench" / "results" / "distill.json"
    earlier = json.loads(last.read_text()) if args.only and last.exists() else {}
    previous = earlier.get("runs", {})
    load_start = load_average()
    teacher_path, student_path = warmup_checkpoint(None), warmup_checkpoint(args.student_sft_steps)
    if "teacher_accuracy" in earlier:  # the same teacher checkpoint and held-out set
        teacher = float(earlier["teacher_accuracy"])
    else:
        teacher_metrics = train(args.runs_dir / "teacher_eval", [f"model.path={teacher_path}", "trainer.total_steps=0",
                                                                 "trainer.val_before_train=false"])
        teacher = curve(teacher_metrics)[-1][1]
    runs: dict[str, dict] = {}
    for name, (folder, overrides) in variants(student_path, teacher_path, args.steps).items():
        if args.only and folder not in args.only:
            if name in previous:
                runs[name] = previous[name]
            continue
        metrics = train(args.runs_dir / folder, overrides)
        runs[name] = {"accuracy": curve(metrics), "reverse_kl": kl_curve(metrics), "overrides": overrides,
                      "response_length": [m["rollout/response_length_mean"] for m in metrics
                                          if "rollout/response_length_mean" in m],
                      "summary": json.loads((args.runs_dir / folder / "summary.json").read_text())}
    rows = []
    for name, run in runs.items():
        acc, kl, length = run["accuracy"], run["reverse_kl"], run["response_length"]
        first, last = (statistics.fmean(v for _, v in kl[:5]), statistics.fmean(v for _, v in kl[-5:])) if kl else (0, 0)
        rows.append([name, *(f"{a:.2f}" for _, a in acc), f"{first:.3f} -> {last:.3f}" if kl else "-",
                     f"{statistics.fmean(length[:5]):.0f} -> {statistics.fmean(length[-5:]):.0f}",
                     f"{run['summary']['wall_seconds']:.0f}"])
    steps = [s for s, _ in next(iter(runs.values()))["accuracy"]]
    text = table(["run", *(f"@{s}" for s in steps), "reverse KL (mean of first 5 -> last 5 steps)",
                  "response tokens (first 5 -> last 5)", "wall s"],
                 rows, title=f"student held-out accuracy by step (teacher {teacher:.2f}; greedy, n=100)")
    plotted = plot(runs, teacher, PNG)
    print(f"plot: {PNG}" if plotted else "plot: matplotlib is not installed", flush=True)
    write_result("distill", {
        "what": __doc__, "teacher": str(teacher_path), "student": str(student_path), "teacher_accuracy": teacher,
        "steps": args.steps, "trajectories_per_step": 32, "runs": runs, "table": text,
        "plot": str(PNG) if plotted else None, "load_average_at_start": load_start,
        "versions": versions("torch", "transformers"),
    })


if __name__ == "__main__":
    main()
