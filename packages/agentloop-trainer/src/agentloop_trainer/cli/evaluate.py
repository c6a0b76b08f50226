"""``agentloop eval`` and ``agentloop rollout``: checkpoints on held-out sets.

``agentloop eval CKPT [CKPT ...] [--data FILE ...] [key=value ...]`` samples
``actor_rollout_ref.rollout.val_kwargs.n`` responses per problem of every set (one per
``data_source``; ``--data`` files, else ``data.val_files``, else the built-in task) and prints one
table, checkpoint x set, of pass@1, pass@k, avg@k and maj@k with standard errors
(:mod:`agentloop_trainer.eval`); ``--out`` writes it as JSON.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from agentloop_core.console import console_safe
from agentloop_trainer.config.sections import TrainConfig
from agentloop_trainer.eval.metrics import ProblemSamples, default_ks, set_metrics
from agentloop_trainer.eval.report import SetResult, format_table, write_json
from agentloop_trainer.eval.sets import problems_by_set
from agentloop_trainer.rollout.rollouts import make_rows
from agentloop_trainer.stages.memory import map_large_host_blocks
from agentloop_trainer.stages.rollout_setup import (
    checked_tokenizer,
    evaluate_checkpoint,
    ray_session,
    rollout_fleet,
    run_records,
    tool_schemas,
)

__all__ = ["add_eval_parser", "check_ks", "eval_records", "evaluate_checkpoint", "evaluate_sets", "run_eval",
           "write_rollouts"]


def _tokenizer(cfg: TrainConfig, checkpoint: str | Path) -> Any:
    """The checkpoint's tokenizer, checked (:func:`~agentloop_trainer.stages.rollout_setup.checked_tokenizer`)."""
    path = Path(checkpoint)
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"{path} is not a Hugging Face checkpoint folder (no config.json)")
    return checked_tokenizer(cfg, path)


def write_rollouts(cfg: TrainConfig, checkpoint: str | Path, out: str | Path, num_prompts: int = 16,
                   on_batch: Callable[[list[dict], Any], None] | None = None) -> Path:
    """Sample ``rollout.n`` trajectories for the first ``num_prompts`` held-out prompts and
    write one JSON object per trajectory (token ids and their decoded text, mask, log-probs,
    reward, messages), or per segment of a trajectory whose loop split it (``segment_index`` 0,
    1, ...); ``agentloop view`` renders the file. ``on_batch(rows, batch)`` sees the rolled-out
    ``RolloutBatch`` (the CLI counts its failed samples)."""
    from agentloop_trainer.view.viewer import trajectory_records, write_jsonl

    tokenizer = _tokenizer(cfg, checkpoint)
    _, test = run_records(cfg, tokenizer, print)
    with ray_session(cfg, print):
        fleet = rollout_fleet(cfg, checkpoint, tokenizer, name="agentloop-eval")
        try:
            rows = make_rows(test[:num_prompts], cfg.actor_rollout_ref.rollout.n, tag="rollout")
            batch = fleet.generate(rows)
        finally:
            fleet.close()
    if on_batch is not None:
        on_batch(rows, batch)
    return write_jsonl(trajectory_records(batch, rows, tokenizer), out)


def _val_files(cfg: TrainConfig, files: Sequence[str]) -> list[str]:
    """``--data`` files, else ``data.val_files`` (one file or a list, verl's forms)."""
    if files:
        return list(files)
    v = cfg.data.val_files
    if v is None:
        return []
    return [str(v)] if isinstance(v, (str, Path)) else [str(f) for f in v]


def eval_records(cfg: TrainConfig, tokenizer: Any, files: Sequence[str], limit: int | None,
                 log: Callable[[str], None] = print) -> list[dict[str, Any]]:
    """The held-out rows of every set: each file's first ``limit`` rows (all: None), a parquet
    file in verl's layout or a GSM8K ``.jsonl`` (converted as ``agentloop data gsm8k`` does);
    without files, the built-in task's held-out split. Prompts over ``data.max_prompt_length``
    are dropped with a count, as in training.

    Raises:
        FileNotFoundError: a file that does not exist.
        ValueError: a file with no usable row.
    """
    from agentloop_trainer.data.gsm8k import read_gsm8k_jsonl
    from agentloop_trainer.data.rows import limit_prompt_length, read_parquet_files

    paths = _val_files(cfg, files)
    if not paths:
        return run_records(cfg, tokenizer, log)[1][:limit]
    rows: list[dict[str, Any]] = []
    for f in paths:
        path = Path(f)
        if not path.is_file():
            raise FileNotFoundError(f"{f}: no such file (a parquet file in verl's layout, or GSM8K's test.jsonl)")
        if path.suffix == ".jsonl":
            part, bad = read_gsm8k_jsonl(path, "test")
            if bad:
                log(f"{f}: skipped {len(bad)} malformed lines (first: line {bad[0][0]}: {bad[0][1]})")
        else:
            part = read_parquet_files(str(path), f, need_ground_truth=cfg.reward.source != "loop",
                                      image_key=cfg.data.image_key)
        kept, dropped = limit_prompt_length(part[:limit], tokenizer, tool_schemas(cfg), cfg.data.max_prompt_length,
                                            cfg.data.filter_overlong_prompts, f)
        if dropped:
            log(f"{f}: dropped {dropped} prompts longer than data.max_prompt_length={cfg.data.max_prompt_length}")
        if not kept:
            raise ValueError(f"{f}: no row to evaluate")
        rows.extend(kept)
    return rows


def check_ks(ks: Sequence[int] | None, n: int) -> list[int]:
    """The k to report: ``ks``, else 1, the powers of two below ``n``, and ``n``.

    Raises:
        ValueError: a k outside ``1..n``, naming the fix.
    """
    if not ks:
        return default_ks(n)
    bad = [k for k in ks if not 1 <= k <= n]
    if bad:
        raise ValueError(f"k={bad[0]} needs at least {bad[0]} samples per problem but "
                         f"actor_rollout_ref.rollout.val_kwargs.n={n}; raise val_kwargs.n or ask for k <= {n}")
    return sorted(set(ks))


def evaluate_sets(cfg: TrainConfig, checkpoint: str | Path, records: Sequence[dict[str, Any]],
                  ks: Sequence[int], tokenizer: Any, chunk: int = 64,
                  progress: bool = True) -> tuple[list[SetResult], list[str], int]:
    """Sample ``val_kwargs.n`` responses per problem of ``records`` with ``checkpoint``, a chunk of
    about ``chunk`` samples (whole problems) at a time under a progress bar over samples.

    Returns:
        ``(one SetResult per data_source, the failed samples' errors, samples drawn)``.
    """
    from tqdm import tqdm

    from agentloop_trainer.rollout.diagnostics import batch_errors

    n = cfg.actor_rollout_ref.rollout.val_kwargs.n
    per_chunk = max(1, chunk // n)
    problems: dict[str, list[ProblemSamples]] = {}
    failed: dict[str, int] = {}
    errors: list[str] = []
    with ray_session(cfg, print):
        fleet = rollout_fleet(cfg, checkpoint, tokenizer, name="agentloop-eval")
        bar = tqdm(total=len(records) * n, desc=f"eval {Path(checkpoint).name}", unit="sample",
                   disable=not progress, file=sys.stderr)
        try:
            for c, start in enumerate(range(0, len(records), per_chunk)):
                # step=c keeps every problem's group id (and sampling seeds) distinct across chunks.
                rows = make_rows(records[start:start + per_chunk], n, step=c, tag="eval")
                batch = fleet.generate(rows, validate=True)
                errors.extend(batch_errors(batch))
                for source, found in problems_by_set(rows, batch, tokenizer, fleet.scorer).items():
                    problems.setdefault(source, []).extend(found)
                for t in set(np.asarray(batch.trajectory_index)[np.asarray(batch.failed, dtype=bool)].tolist()):
                    key = str(rows[t].get("data_source"))
                    failed[key] = failed.get(key, 0) + 1
                bar.update(len(rows))
        finally:
            bar.close()
            fleet.close()
    results = [SetResult(str(checkpoint), source, len(p), n, set_metrics(p, ks), failed.get(source, 0))
               for source, p in sorted(problems.items())]
    return results, errors, len(records) * n


def add_eval_parser(sub: Any) -> argparse.ArgumentParser:
    """The ``agentloop eval`` subcommand on ``sub`` (the parser's subparsers)."""
    ev = sub.add_parser("eval", help="pass@k / avg@k / maj@k with standard errors of checkpoints on held-out sets")
    ev.add_argument("targets", nargs="+", metavar="CHECKPOINT|key=value",
                    help="Hugging Face checkpoint folders (one or more), then config overrides, e.g. "
                         "actor_rollout_ref.rollout.val_kwargs.n=4 actor_rollout_ref.rollout.val_kwargs.temperature=0.7 "
                         "actor_rollout_ref.rollout.val_kwargs.do_sample=true")
    ev.add_argument("--config", help="YAML file merged over the defaults")
    ev.add_argument("--data", action="append", default=[], metavar="FILE",
                    help="a held-out set (repeatable): parquet in verl's layout, or GSM8K's test.jsonl; "
                         "default: data.val_files, else the built-in task")
    ev.add_argument("--limit", type=int, default=None, metavar="N", help="only the first N problems of each file")
    ev.add_argument("-k", type=int, action="append", default=None, metavar="K",
                    help="report pass@K (repeatable; default 1, powers of two, and n)")
    ev.add_argument("--out", default=None, metavar="FILE.json", help="also write the table as JSON")
    ev.add_argument("--chunk", type=int, default=64, help="samples rolled out at a time (default 64)")
    ev.add_argument("--no-progress", action="store_true", help="no progress bar")
    ev.set_defaults(func=run_eval, overrides=[])
    return ev


def run_eval(args: argparse.Namespace) -> int:
    """``agentloop eval``: the table on stdout (and ``--out``); exit 1 when every sample failed,
    2 on a usage error (one line on stderr)."""
    from agentloop_trainer.config.loading import load_config
    from agentloop_trainer.rollout.diagnostics import report_failures

    overrides = [t for t in [*args.targets, *args.overrides] if "=" in t]
    checkpoints = [t for t in args.targets if "=" not in t]
    try:
        if not checkpoints:
            raise ValueError("name at least one checkpoint folder (before the key=value overrides)")
        if args.limit is not None and args.limit < 1:
            raise ValueError(f"--limit must be at least 1, got {args.limit}")
        cfg = load_config(overrides, args.config)
        n = cfg.actor_rollout_ref.rollout.val_kwargs.n
        ks = check_ks(args.k, n)
        for c in checkpoints:
            if not (Path(c) / "config.json").is_file():
                raise FileNotFoundError(f"{c} is not a Hugging Face checkpoint folder (no config.json)")
        tokenizers = {c: _tokenizer(cfg, c) for c in checkpoints}
        records = eval_records(cfg, tokenizers[checkpoints[0]], args.data, args.limit)
    except (FileNotFoundError, ValueError) as exc:
        print(f"agentloop eval: {console_safe(exc)}", file=sys.stderr)
        return 2
    map_large_host_blocks(cfg.trainer)  # as `agentloop train` does
    results: list[SetResult] = []
    code = 0
    for c in checkpoints:
        found, errors, total = evaluate_sets(cfg, c, records, ks, tokenizers[c], args.chunk, not args.no_progress)
        if len(errors) < total:  # a table of nothing but failures would read as a result
            results.extend(found)
        code = max(code, report_failures(errors, total, "eval", print))
    if results:
        print(console_safe(format_table(results)))
    if args.out:
        v = cfg.actor_rollout_ref.rollout.val_kwargs
        settings = {"n": n, "k": ks, "temperature": v.temperature, "top_p": v.top_p, "top_k": v.top_k,
                    "do_sample": v.do_sample, "limit": args.limit, "files": _val_files(cfg, args.data) or ["built-in"]}
        print(f"JSON: {write_json(results, settings, args.out).resolve()}")
    return code
