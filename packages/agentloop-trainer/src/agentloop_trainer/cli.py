"""The ``agentloop`` command line.

``agentloop train`` with no arguments builds (or reuses) the tiny tokenizer, the tiny model and
its SFT warm-up checkpoint, runs GRPO on the synthetic calculator task, evaluates before and
after on the held-out split, and writes everything under ``./outputs/<run-name>/``.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def _log(message: str) -> None:
    from tqdm import tqdm

    tqdm.write(message)


def run_train(cfg: Any, log: Any = _log) -> tuple[Path, dict[str, Any]]:
    """Run a full training job for ``cfg``; returns the run folder and the summary."""
    import random

    import numpy as np
    import torch

    from agentloop_trainer.assets import load_records, load_tokenizer, sft_checkpoint
    from agentloop_trainer.config import to_yaml
    from agentloop_trainer.trainer import ray_session

    tc = cfg.trainer
    name = tc.experiment_name or time.strftime("run-%Y%m%d-%H%M%S")
    run_dir = Path(tc.output_dir) / name
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(to_yaml(cfg))
    wall = time.perf_counter()
    tokenizer = load_tokenizer(cfg)
    model_path = Path(cfg.model.path) if cfg.model.path else sft_checkpoint(cfg, tokenizer, log)
    data_stats: dict[str, int] = {}
    train, test = load_records(cfg, tokenizer, log, data_stats)
    random.seed(tc.seed)
    np.random.seed(tc.seed)
    torch.manual_seed(tc.seed)
    with ray_session(cfg, log):
        summary = _fit(cfg, model_path, tokenizer, train, test, run_dir, log)
    summary["total_wall_seconds"] = time.perf_counter() - wall
    summary["start_checkpoint"] = str(model_path)
    summary.update(data_stats)
    import json

    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    return run_dir, summary


def _fit(cfg: Any, model_path: Path, tokenizer: Any, train: list, test: list, run_dir: Path, log: Any) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from agentloop_trainer.config import uses_ray
    from agentloop_trainer.trainer import GRPOTrainer

    tc = cfg.trainer
    if tc.fsdp_ranks > 1:
        from agentloop_trainer.fsdp import run_fsdp_training

        if uses_ray(cfg) and cfg.ray.address is None:
            # Spawned ranks are not Ray workers: rank 0 joins the cluster this driver runs by address.
            import ray
            from omegaconf import OmegaConf

            cfg = OmegaConf.merge(cfg, {"ray": {"address": ray.get_runtime_context().gcs_address}})

        summary = run_fsdp_training(cfg, model_path, run_dir, launcher=tc.launcher,
                                    num_cpus_per_rank=cfg.ray.rank_num_cpus,
                                    num_gpus_per_rank=cfg.ray.rank_num_gpus, strategy=cfg.ray.placement_strategy)
    else:
        model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch.float32)
        # On the ray backend the replicas load the checkpoint themselves.
        engine_model = None if uses_ray(cfg) else AutoModelForCausalLM.from_pretrained(str(model_path),
                                                                                         dtype=torch.float32)
        trainer = GRPOTrainer(cfg, model, engine_model, tokenizer, train, test, run_dir, log=log,
                              model_path=model_path)
        try:
            summary = trainer.fit()
        finally:
            trainer.close()
    return summary


def _train(args: argparse.Namespace) -> int:
    from agentloop_trainer.config import ConfigError, load_config, to_yaml

    overrides = list(args.overrides)
    if args.resume:
        overrides.append("trainer.resume=true")
    try:
        cfg = load_config(overrides, args.config)
    except ConfigError as exc:
        print(f"agentloop train: {exc}", file=sys.stderr)
        return 2
    if args.show_config:
        print(to_yaml(cfg))
        return 0
    run_dir, summary = run_train(cfg)
    print(
        f"\nheld-out accuracy {summary['eval_accuracy_before']:.3f} -> {summary['eval_accuracy_after']:.3f} "
        f"(n={summary['held_out_size']}, seed={summary['seed']}) in {summary['total_wall_seconds']:.0f} s"
    )
    print(f"outputs: {run_dir.resolve()}")
    return 0


def _data_gsm8k(args: argparse.Namespace) -> int:
    from agentloop_trainer.data import convert_gsm8k

    try:
        counts = convert_gsm8k(args.from_jsonl, args.out)
    except (RuntimeError, FileNotFoundError) as exc:
        print(f"agentloop data gsm8k: {exc}", file=sys.stderr)
        return 2
    for split, (ok, bad) in counts.items():
        print(f"{split}: {ok} rows written, {len(bad)} malformed")
        for line, why in bad[:20]:
            print(f"  line {line}: {why}")
    print(f"parquet files in {Path(args.out).resolve()}")
    return 0


def _eval(args: argparse.Namespace) -> int:
    from agentloop_trainer.config import load_config
    from agentloop_trainer.evaluate import evaluate_checkpoint

    cfg = load_config(list(args.overrides), args.config)
    result = evaluate_checkpoint(cfg, args.checkpoint)
    print(f"held-out accuracy {result.accuracy:.3f} (n={result.n}); per template: {result.per_template}")
    return 0


def _rollout(args: argparse.Namespace) -> int:
    from agentloop_trainer.config import load_config
    from agentloop_trainer.evaluate import write_rollouts

    cfg = load_config(list(args.overrides), args.config)
    path = write_rollouts(cfg, args.checkpoint, args.out, args.num_prompts)
    print(f"trajectories: {Path(path).resolve()}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The argument parser (exposed for tests and docs)."""
    parser = argparse.ArgumentParser(prog="agentloop", description="Agentic RL for LLMs: GRPO over agent loops.")
    sub = parser.add_subparsers(dest="command", required=True)

    train = sub.add_parser("train", help="SFT warm-up (cached) + GRPO + held-out eval; key=value overrides")
    train.add_argument("overrides", nargs="*", help="config overrides, e.g. trainer.total_steps=20")
    train.add_argument("--config", help="YAML file merged over the defaults")
    train.add_argument("--resume", action="store_true", help="continue the run named by trainer.experiment_name")
    train.add_argument("--show-config", action="store_true", help="print the resolved config and exit")
    train.set_defaults(func=_train)

    data = sub.add_parser("data", help="prepare datasets")
    data_sub = data.add_subparsers(dest="dataset", required=True)
    gsm = data_sub.add_parser("gsm8k", help="GSM8K jsonl -> train/test parquet for the tool agent")
    gsm.add_argument("--out", required=True, help="output folder")
    gsm.add_argument("--from-jsonl", default=None,
                     help="folder with GSM8K's train.jsonl and test.jsonl (default: download openai/gsm8k)")
    gsm.set_defaults(func=_data_gsm8k)

    ev = sub.add_parser("eval", help="greedy held-out accuracy of a checkpoint")
    ev.add_argument("checkpoint", help="Hugging Face checkpoint folder")
    ev.add_argument("overrides", nargs="*")
    ev.add_argument("--config")
    ev.set_defaults(func=_eval)

    ro = sub.add_parser("rollout", help="roll out held-out prompts and write trajectories as JSONL")
    ro.add_argument("checkpoint", help="Hugging Face checkpoint folder")
    ro.add_argument("overrides", nargs="*")
    ro.add_argument("--config")
    ro.add_argument("--out", default="trajectories.jsonl")
    ro.add_argument("--num-prompts", type=int, default=16)
    ro.set_defaults(func=_rollout)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``agentloop`` console script."""
    parser = build_parser()
    # key=value overrides may come before or after options; argparse stops collecting a
    # positional list at the first option, so gather the stragglers here.
    args, extra = parser.parse_known_args(argv)
    unknown = [e for e in extra if e.startswith("-") or "=" not in e]
    if unknown or (extra and not hasattr(args, "overrides")):
        parser.error(f"unrecognized arguments: {' '.join(unknown or extra)}")
    if extra:
        args.overrides = list(args.overrides) + extra
    return int(args.func(args) or 0)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
