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

from agentloop_core.console import console_safe, install_console_logging
from agentloop_trainer.config.sections import TrainConfig


def _log(message: str) -> None:
    from tqdm import tqdm

    # Log lines quote model output and tool errors: escaped so a terminal never obeys them.
    tqdm.write(console_safe(message))


def run_dir_of(cfg: TrainConfig) -> Path:
    """The run folder: ``trainer.run_dir``, else ``<output_dir>/<experiment_name or a timestamp>``."""
    tc = cfg.trainer
    if tc.run_dir:
        return Path(tc.run_dir)
    return Path(tc.output_dir) / (tc.experiment_name or time.strftime("run-%Y%m%d-%H%M%S"))


def run_train(cfg: TrainConfig, log: Any = _log) -> tuple[Path, dict[str, Any]]:
    """Run a full training job for ``cfg``; returns the run folder and the summary."""
    import json

    from agentloop_trainer.checkpoint.common import checkpoint_to_resume
    from agentloop_trainer.config.loading import to_yaml
    from agentloop_trainer.stages.rollout_setup import checked_tokenizer, ray_session

    run_dir = run_dir_of(cfg)
    # Before the SFT warm-up and model loading: a --resume with nothing to resume fails in seconds.
    checkpoint_to_resume(run_dir / "checkpoints", cfg.trainer.resume)
    # So does a chat template that would hide the tools from the model (before the pre-RL eval).
    checked_tokenizer(cfg)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(to_yaml(cfg))
    wall = time.perf_counter()
    from agentloop_trainer.stages.memory import map_large_host_blocks
    from agentloop_trainer.stages.sft.stage import start_checkpoint

    map_large_host_blocks(cfg.trainer)

    model_path, sft_summary = start_checkpoint(cfg, run_dir, log)
    data_stats: dict[str, int] = {}
    with ray_session(cfg, log):
        summary = _fit(cfg, model_path, run_dir, log, data_stats)
    summary["total_wall_seconds"] = time.perf_counter() - wall
    summary["start_checkpoint"] = str(model_path)
    summary.update(data_stats)
    if sft_summary:
        summary.update(sft_summary)
        summary["eval_accuracy_after_sft"] = summary.get("eval_accuracy_before")
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    return run_dir, summary


def _fit(cfg: TrainConfig, model_path: Path, run_dir: Path, log: Any, stats: dict[str, int]) -> dict:
    from agentloop_trainer.config.accessors import uses_ray
    from agentloop_trainer.stages.build import build_trainer

    tc = cfg.trainer
    if tc.fsdp_ranks > 1:
        from agentloop_trainer.stages.build import run_fsdp_training

        if uses_ray(cfg) and cfg.ray.address is None:
            # Spawned ranks are not Ray workers: rank 0 joins the cluster this driver runs by address.
            import ray

            from agentloop_trainer.config.nodes import merged_config

            cfg = merged_config(cfg, {"ray": {"address": ray.get_runtime_context().gcs_address}})

        return run_fsdp_training(cfg, model_path, run_dir, launcher=tc.launcher,
                                 num_cpus_per_rank=cfg.ray.rank_num_cpus,
                                 num_gpus_per_rank=cfg.ray.rank_num_gpus, strategy=cfg.ray.placement_strategy)
    trainer = build_trainer(cfg, model_path, run_dir, log, stats=stats)
    try:
        return trainer.fit()
    finally:
        trainer.close()


def _train(args: argparse.Namespace) -> int:
    from agentloop_trainer.checkpoint.common import CheckpointError
    from agentloop_trainer.config.errors import ConfigError
    from agentloop_trainer.config.loading import config_file_of, load_config, to_yaml

    overrides = list(args.overrides)
    if args.resume:
        overrides.append("trainer.resume=must")
    if args.resume_or_start:
        overrides.append("trainer.resume=auto")
    try:
        cfg = load_config(overrides, config_file_of(args.config, args.config_path, args.config_name))
    except ConfigError as exc:
        print(f"agentloop train: {console_safe(exc)}", file=sys.stderr)
        return 2
    if args.show_config:
        print(to_yaml(cfg))
        return 0
    try:
        run_dir, summary = run_train(cfg)
    except CheckpointError as exc:
        print(f"agentloop train: {console_safe(exc)}", file=sys.stderr)
        return 2
    before = summary["eval_accuracy_before"]
    print(
        f"\nheld-out accuracy {'-' if before is None else f'{before:.3f}'} -> {summary['eval_accuracy_after']:.3f} "
        f"(n={summary['held_out_size']}, seed={summary['seed']}) in {summary['total_wall_seconds']:.0f} s"
    )
    print(f"outputs: {run_dir.resolve()}")
    if summary.get("final_hf_dir"):
        print(f"final model (Hugging Face folder): {Path(summary['final_hf_dir']).resolve()}")
    return 0


def _data_gsm8k(args: argparse.Namespace) -> int:
    from agentloop_trainer.data.gsm8k import convert_gsm8k

    try:
        counts = convert_gsm8k(args.from_jsonl, args.out)
    except (RuntimeError, FileNotFoundError) as exc:
        print(f"agentloop data gsm8k: {console_safe(exc)}", file=sys.stderr)
        return 2
    for split, (ok, bad) in counts.items():
        print(f"{split}: {ok} rows written, {len(bad)} malformed")
        for line, why in bad[:20]:
            print(f"  line {line}: {console_safe(why)}")
    print(f"parquet files in {Path(args.out).resolve()}")
    return 0


def _sft(args: argparse.Namespace) -> int:
    from agentloop_trainer.checkpoint.common import CheckpointError
    from agentloop_trainer.config.errors import ConfigError
    from agentloop_trainer.config.loading import load_config
    from agentloop_trainer.stages.memory import map_large_host_blocks
    from agentloop_trainer.stages.sft.stage import run_sft

    try:
        cfg = load_config([*args.overrides, *(["sft.resume=must"] if args.resume else [])], args.config)
        map_large_host_blocks(cfg.trainer)  # as `agentloop train` does
        path, _ = run_sft(cfg, run_dir_of(cfg), _log)
    except (ConfigError, CheckpointError, ValueError, FileNotFoundError) as exc:
        print(f"agentloop sft: {console_safe(exc)}", file=sys.stderr)
        return 2
    print(f"fine-tuned model: {path.resolve()}")
    return 0


def _data_calculator_sft(args: argparse.Namespace) -> int:
    from agentloop_trainer.stages.sft.data import write_calculator_sft

    try:
        path = write_calculator_sft(args.out, args.n, args.seed, args.flip_prob, args.answer_format)
    except ValueError as exc:
        print(f"agentloop data calculator-sft: {console_safe(exc)}", file=sys.stderr)
        return 2
    print(f"{args.n} calculator demonstrations in {Path(path).resolve()}")
    return 0


def _data_cards(args: argparse.Namespace) -> int:
    import json
    import shutil

    from agentloop_trainer.data import write_parquet_rows
    from agentloop_trainer.task.cards import TOOL_CONFIG, card_demonstrations, card_rows

    out = Path(args.out)
    # Seeds: training cards, held-out cards and the demonstrations' cards are different draws.
    write_parquet_rows(card_rows(args.n_train, args.seed), out / "train.parquet")
    write_parquet_rows(card_rows(args.n_val, args.seed + 1), out / "val.parquet")
    with (out / "sft.jsonl").open("w") as fh:  # images as data URLs: JSON holds them as they are
        for row in card_demonstrations(args.n_sft, args.seed + 2, args.flip_prob):
            fh.write(json.dumps(row) + "\n")
    shutil.copyfile(TOOL_CONFIG, out / "tools.yaml")
    print(f"{args.n_train} training and {args.n_val} held-out cards, {args.n_sft} demonstrations and tools.yaml "
          f"in {out.resolve()}")
    return 0


def _data_env(args: argparse.Namespace) -> int:
    from agentloop_trainer.data import write_parquet_rows
    from agentloop_trainer.task.environments import ENVIRONMENT_ROWS

    make = ENVIRONMENT_ROWS[args.environment]
    out = Path(args.out)
    write_parquet_rows(make(args.n_train, args.seed, "train"), out / "train.parquet")
    write_parquet_rows(make(args.n_val, args.seed + 1_000_003, "test"), out / "val.parquet")
    print(f"{args.n_train} train and {args.n_val} held-out {args.environment} rows (agent_name env_agent) in "
          f"{out.resolve()}/train.parquet and val.parquet")
    return 0


def _rollout(args: argparse.Namespace) -> int:
    from agentloop_trainer.cli.evaluate import write_rollouts
    from agentloop_trainer.config.loading import load_config

    cfg = load_config(list(args.overrides), args.config)
    from agentloop_trainer.rollout.diagnostics import batch_errors, report_failures

    seen: list[tuple[int, list[str]]] = []
    path = write_rollouts(cfg, args.checkpoint, args.out, args.num_prompts,
                          on_batch=lambda rows, batch: seen.append((len(rows), batch_errors(batch))))
    print(f"trajectories: {Path(path).resolve()}")
    return report_failures(seen[0][1], seen[0][0], "rollout", print) if seen else 0


def _view(args: argparse.Namespace) -> int:
    from agentloop_trainer.view.viewer import write_view

    tokenizer = None
    if args.tokenizer:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    try:
        out = write_view(args.path, args.out, tokenizer=tokenizer)
    except (FileNotFoundError, ValueError) as exc:
        print(f"agentloop view: {console_safe(exc)}", file=sys.stderr)
        return 2
    print(out.resolve())
    return 0


def _serve(args: argparse.Namespace) -> int:
    # The serving itself is agentloop-engines' (`agentloop-serve`); here the engine comes from a
    # training config (actor_rollout_ref.rollout.* overrides), as a run would build it.
    from agentloop_engines.cli import read_serve_keys, serve_engine
    from agentloop_trainer.config.loading import load_config
    from agentloop_trainer.policy.tokenizer import load_tokenizer
    from agentloop_trainer.rollout.engines import build_engine, remote_engines
    from agentloop_trainer.stages.rollout_setup import engine_config

    cfg = load_config(list(args.overrides), args.config)
    keys = read_serve_keys(args)
    if args.chat_template:  # the flag wins over the config key
        from omegaconf import read_write

        from agentloop_trainer.config.nodes import config_node

        with read_write(config_node(cfg)):
            cfg.model.custom_chat_template = args.chat_template
    engine_cfg = engine_config(cfg, args.checkpoint, cfg.model.tokenizer_path)
    tokenizer = load_tokenizer(cfg.model, engine_cfg.model_path)
    r = cfg.actor_rollout_ref.rollout
    # Over running engine servers: the router (least in-flight, sticky per session).
    engine = remote_engines(r) if r.server_urls else build_engine(engine_cfg, tokenizer=tokenizer)
    where = f"{len(r.server_urls)} replicas" if r.server_urls else engine_cfg.name
    return serve_engine(engine, tokenizer, args, keys, label=f"{args.checkpoint} ({where})",
                        tool_parser=r.multi_turn.tool_parser, reasoning_parser=r.multi_turn.reasoning_parser)


def _model(args: argparse.Namespace) -> int:
    from agentloop_trainer.pretrained.command import run_model_command

    return run_model_command(args)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser (exposed for tests and docs)."""
    parser = argparse.ArgumentParser(prog="agentloop", description="Agentic RL for LLMs: GRPO over agent loops.")
    sub = parser.add_subparsers(dest="command", required=True)

    train = sub.add_parser("train", help="SFT warm-up (cached) + GRPO + held-out eval; key=value overrides")
    train.add_argument("overrides", nargs="*", help="config overrides, e.g. trainer.total_steps=20")
    train.add_argument("--config", help="YAML file merged over the defaults")
    train.add_argument("--config-path", "-cp", help="verl's (Hydra's) form: the folder of --config-name")
    train.add_argument("--config-name", "-cn", help="verl's (Hydra's) form: <config-path>/<name>.yaml is the config "
                                                  "file; verl's base config ppo_trainer reads agentloop's defaults")
    resume = train.add_mutually_exclusive_group()
    resume.add_argument("--resume", action="store_true",
                        help="continue the run named by trainer.experiment_name; an error if it has no checkpoint")
    resume.add_argument("--resume-or-start", action="store_true",
                        help="continue the run if it has a checkpoint, else start it (trainer.resume=auto)")
    train.add_argument("--show-config", action="store_true", help="print the resolved config and exit")
    train.set_defaults(func=_train)

    data = sub.add_parser("data", help="prepare datasets")
    data_sub = data.add_subparsers(dest="dataset", required=True)
    gsm = data_sub.add_parser("gsm8k", help="GSM8K jsonl -> train/test parquet for the tool agent")
    gsm.add_argument("--out", required=True, help="output folder")
    gsm.add_argument("--from-jsonl", default=None,
                     help="folder with GSM8K's train.jsonl and test.jsonl (default: download openai/gsm8k)")
    gsm.set_defaults(func=_data_gsm8k)

    calc = data_sub.add_parser("calculator-sft", help="calculator-task demonstrations as SFT rows (messages, tools)")
    calc.add_argument("--out", required=True, help="output file (.parquet or .jsonl)")
    calc.add_argument("--n", type=int, default=1000, help="rows (default 1000)")
    calc.add_argument("--seed", type=int, default=0, help="problem seed (default 0)")
    calc.add_argument("--flip-prob", type=float, default=0.0,
                      help="chance the teacher flips the last operator on the biased templates (default 0: correct)")
    calc.add_argument("--answer-format", default="#### {answer}",
                      help="final answer text with {answer} (default '#### {answer}'; e.g. 'The answer is {answer}.')")
    calc.set_defaults(func=_data_calculator_sft)

    cards = data_sub.add_parser("cards", help="the vision task: cards whose colour only show_card's picture shows "
                                              "(train/val parquet, sft.jsonl with a biased teacher)")
    cards.add_argument("--out", required=True, help="output folder")
    cards.add_argument("--n-train", type=int, default=2000, help="training cards (default 2000)")
    cards.add_argument("--n-val", type=int, default=200, help="held-out cards (default 200)")
    cards.add_argument("--n-sft", type=int, default=2000, help="demonstrations (default 2000)")
    cards.add_argument("--seed", type=int, default=0, help="seed (default 0)")
    cards.add_argument("--flip-prob", type=float, default=0.6,
                       help="chance the teacher names the wrong neighbour of orange, cyan or pink (default 0.6)")
    cards.set_defaults(func=_data_cards)

    env = data_sub.add_parser("env", help="rows of a shipped environment (env_agent loop): train/val parquet")
    env.add_argument("environment", choices=["number_guess", "calculator"], help="the environment")
    env.add_argument("--out", required=True, help="output folder (train.parquet, val.parquet)")
    env.add_argument("--n-train", type=int, default=256, help="training rows (default 256)")
    env.add_argument("--n-val", type=int, default=32, help="held-out rows (default 32)")
    env.add_argument("--seed", type=int, default=0, help="seed (default 0)")
    env.set_defaults(func=_data_env)

    sft = sub.add_parser("sft", help="supervised fine-tuning of model.path (or the tiny model) on sft.train_files "
                                     "into <run>/sft/hf; key=value overrides")
    sft.add_argument("overrides", nargs="*", help="config overrides, e.g. sft.train_files=demos.parquet")
    sft.add_argument("--config", help="YAML file merged over the defaults")
    sft.add_argument("--resume", action="store_true", help="continue the stage from its latest checkpoint (sft.resume=must)")
    sft.set_defaults(func=_sft)

    from agentloop_trainer.cli.evaluate import add_eval_parser

    add_eval_parser(sub)

    ro = sub.add_parser("rollout", help="roll out held-out prompts and write trajectories as JSONL")
    ro.add_argument("checkpoint", help="Hugging Face checkpoint folder")
    ro.add_argument("overrides", nargs="*")
    ro.add_argument("--config")
    ro.add_argument("--out", default="trajectories.jsonl")
    ro.add_argument("--num-prompts", type=int, default=16)
    ro.set_defaults(func=_rollout)

    vw = sub.add_parser("view", help="write one self-contained HTML page of trajectories (a run folder or an "
                                     "`agentloop rollout` JSONL) and print its path")
    vw.add_argument("path", help="run folder (its trajectories/step_<N>.jsonl) or a trajectories JSONL")
    vw.add_argument("--out", default=None, help="the HTML file (default: <run>/view.html, or <jsonl>.html)")
    vw.add_argument("--tokenizer", default=None,
                    help="tokenizer folder to decode token ids that records carry without their text")
    vw.set_defaults(func=_view)

    sv = sub.add_parser("serve", help="serve a checkpoint behind an OpenAI-compatible API with per-session "
                                      "token recording (and /generate)")
    sv.add_argument("checkpoint", help="Hugging Face checkpoint folder")
    sv.add_argument("overrides", nargs="*", help="config overrides: actor_rollout_ref.rollout.name=vllm, "
                                                 "or rollout.server_urls=[...] to route over running engines")
    sv.add_argument("--config")
    from agentloop_engines.cli import add_serve_options

    add_serve_options(sv)  # the options of `agentloop-serve`: address, keys, limits, chat template
    sv.set_defaults(func=_serve)

    from agentloop_trainer.pretrained.command import add_model_parser

    add_model_parser(sub).set_defaults(func=_model)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``agentloop`` console script."""
    install_console_logging()  # warnings that quote model or tool text are escaped on the console
    parser = build_parser()
    # key=value overrides may come before or after options; argparse stops collecting a
    # positional list at the first option, so gather the stragglers here.
    args, extra = parser.parse_known_args(argv)
    unknown = [e for e in extra if e.startswith("-") or "=" not in e]
    if unknown or (extra and not hasattr(args, "overrides")):
        parser.error(f"unrecognized arguments: {' '.join(unknown or extra)}")
    if extra:
        args.overrides = list(args.overrides) + extra
    from agentloop_trainer.config.errors import ConfigError

    try:
        return int(args.func(args) or 0)
    except ConfigError as exc:  # a wrong key or value, found before the run started
        print(f"agentloop {args.command}: {console_safe(exc)}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
