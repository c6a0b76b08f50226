"""The general SFT stage: any model by ``model.path`` (or the tiny model) on conversations in
verl's multi-turn layout, into a Hugging Face folder GRPO can start from.

``agentloop sft`` runs it alone; ``agentloop train`` runs it first when ``sft.train_files`` is
set. Its folder (``sft.output_dir``, else ``<run>/sft``) holds ``metrics.jsonl``,
``checkpoints/step_<N>`` (``sft.save_freq``), ``summary.json`` and the result, ``hf/``.
"""

from __future__ import annotations

import json
import logging
import math
import resource
import time
from pathlib import Path
from typing import Any

from agentloop_core.runtime.host_memory import release_host_memory
from agentloop_core.vision.processor import load_vision_processor
from agentloop_trainer.config.sections import TrainConfig
from agentloop_trainer.policy.lr_schedules import cosine_lr
from agentloop_trainer.stages.sft.loss import eval_loss, make_optimizer, sft_step
from agentloop_trainer.stages.sft.tokenize import SFTTokenizer, TokenizedConversation

logger = logging.getLogger(__name__)

RESULT_DIR = "hf"
"""The fine-tuned model's folder inside the stage's folder."""


def stage_dir(cfg: TrainConfig, run_dir: str | Path) -> Path:
    """The SFT stage's folder: ``sft.output_dir``, else ``<run_dir>/sft``."""
    return Path(cfg.sft.output_dir) if cfg.sft.output_dir else Path(run_dir) / "sft"


def sft_tokenizer(cfg: TrainConfig, tokenizer: Any) -> SFTTokenizer:
    """An :class:`SFTTokenizer` with the rollout's stop tokens (those of the tool parser
    ``rollout.multi_turn.tool_parser``), so SFT ids end where the rollout's engine would stop."""
    from agentloop_core.parsers import get_tool_parser
    from agentloop_tools.per_tokenizer import stop_token_ids

    parser = get_tool_parser(cfg.actor_rollout_ref.rollout.multi_turn.tool_parser)
    folder = cfg.model.tokenizer_path or cfg.model.path
    vision = load_vision_processor(folder, tokenizer) if folder else None
    return SFTTokenizer(tokenizer, stop_token_ids(tokenizer, parser.stop_tokens), vision=vision)


def tokenize_examples(sft: SFTTokenizer, examples: list, max_length: int, filter_overlong: bool,
                      key: str) -> tuple[list[TokenizedConversation], int]:
    """Tokenize every example; drop (``filter_overlong``) or reject those over ``max_length``.

    Returns:
        ``(kept, number dropped)``.

    Raises:
        ValueError: a conversation cannot be tokenized (its row named), one is too long and
            ``filter_overlong`` is false, or none is left.
    """
    out, over = [], []
    for ex in examples:
        try:
            tc = sft.tokenize(ex.messages, ex.tools)
        except ValueError as exc:
            raise ValueError(f"{ex.source}: {exc}") from None
        if len(tc.input_ids) > max_length:
            over.append((ex.source, len(tc.input_ids)))
        elif tc.trained_tokens:
            out.append(tc)
    if over and not filter_overlong:
        listed = ", ".join(f"{s} ({n} tokens)" for s, n in over[:10])
        raise ValueError(f"{key}: {len(over)} conversations exceed sft.max_length={max_length}: {listed}; raise "
                         "sft.max_length or set sft.filter_overlong=true")
    if not out:
        raise ValueError(f"{key}: no conversation is at most sft.max_length={max_length} tokens; raise it")
    return out, len(over)


def load_sft_model(cfg: TrainConfig, tokenizer: Any) -> Any:
    """``model.path`` in float32 master weights (or a fresh tiny model), with the memory options
    the GRPO actor has: gradient checkpointing, LoRA; on ``trainer.device``."""
    import torch

    from agentloop_trainer.policy.model import (
        apply_lora,
        build_tiny_policy,
        enable_gradient_checkpointing,
        use_cpu_matmul,
    )

    m = cfg.model
    if m.path:
        from agentloop_engines.adapters.hf.vision import load_model

        model = load_model(str(m.path), torch.float32)
    else:
        model = build_tiny_policy(tokenizer, seed=cfg.sft.seed)
    if m.enable_gradient_checkpointing:
        enable_gradient_checkpointing(model)
    if m.lora_rank > 0:
        model = apply_lora(model, m.lora_rank, m.lora_alpha, m.target_modules)
    use_cpu_matmul(model, m.cpu_matmul, cfg.trainer.device)
    # pyright's ignore: PreTrainedModel.to is typed without binding self (see policy.model).
    return model.to(cfg.trainer.device)  # pyright: ignore[reportArgumentType]


def _total_steps(cfg: TrainConfig, n: int) -> int:
    s = cfg.sft
    return int(s.total_steps) if s.total_steps else s.epochs * max(1, n // s.batch_size)


def run_sft(cfg: TrainConfig, run_dir: str | Path, log: Any = print, tokenizer: Any = None) -> tuple[Path, dict[str, Any]]:
    """Fine-tune on ``sft.train_files`` and write the result as a Hugging Face folder.

    A stage whose folder already holds a finished result is not run again (the result is
    returned); ``sft.resume`` continues an unfinished one from its latest checkpoint.

    Args:
        cfg: The config (``model``, ``sft``, ``trainer.device``...).
        run_dir: The run folder (the stage writes into :func:`stage_dir`).
        log: Console printer.
        tokenizer: An already loaded tokenizer; None: ``load_tokenizer(cfg.model)``.

    Returns:
        ``(the Hugging Face folder, the stage's summary)``.

    Raises:
        SFTDataError, ValueError: bad data (rows named) or settings.
        CheckpointError: ``sft.resume=must`` and there is no checkpoint.
    """
    from agentloop_trainer.checkpoint.common import checkpoint_to_resume

    s = cfg.sft
    if not s.train_files:
        raise ValueError("the SFT stage needs sft.train_files (parquet or jsonl conversations; "
                         "`agentloop data calculator-sft --out FILE.parquet` writes some)")
    out = stage_dir(cfg, run_dir)
    result = out / RESULT_DIR
    if (result / ".complete").exists():
        log(f"SFT: reusing the finished stage {result}")
        summary = json.loads((out / "summary.json").read_text()) if (out / "summary.json").exists() else {}
        return result, summary
    start = checkpoint_to_resume(out / "checkpoints", s.resume)
    out.mkdir(parents=True, exist_ok=True)
    return _Stage(cfg, out, log, tokenizer).run(start)


class _Stage:
    """One run of the stage (state a resumed run restores: weights, optimizer, step, data position)."""

    def __init__(self, cfg: TrainConfig, out: Path, log: Any, tokenizer: Any) -> None:
        from agentloop_trainer.policy.tokenizer import load_tokenizer
        from agentloop_trainer.stages.sft.data import read_sft_files

        self.cfg, self.out, self.log = cfg, out, log
        s = cfg.sft
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(cfg.model)
        sft = sft_tokenizer(cfg, self.tokenizer)
        t0 = time.perf_counter()
        self.train, self.dropped = tokenize_examples(sft, read_sft_files(s.train_files, "sft.train_files"),
                                                     s.max_length, s.filter_overlong, "sft.train_files")
        self.val, self.dropped_val = ([], 0) if not s.val_files else tokenize_examples(
            sft, read_sft_files(s.val_files, "sft.val_files"), s.max_length, s.filter_overlong, "sft.val_files")
        for name, n, total in (("sft.train_files", self.dropped, len(self.train)),
                               ("sft.val_files", self.dropped_val, len(self.val))):
            if n:
                log(f"{name}: dropped {n} of {n + total} conversations longer than sft.max_length={s.max_length}")
        if s.batch_size > len(self.train):
            raise ValueError(f"sft.batch_size={s.batch_size} exceeds the {len(self.train)} training conversations; "
                             "lower it")
        self.tokenize_seconds = time.perf_counter() - t0
        self.total = _total_steps(cfg, len(self.train))
        self.dtype = cfg.model.dtype
        self.share_prefix = not cfg.model.enable_gradient_checkpointing

    def run(self, start: Path | None) -> tuple[Path, dict[str, Any]]:
        from tqdm import tqdm

        from agentloop_trainer.data.iterator import DataIterator
        from agentloop_trainer.view.metrics import MetricsLogger

        cfg, s = self.cfg, self.cfg.sft
        model = load_sft_model(cfg, self.tokenizer)
        opt = make_optimizer(model, s.lr, s.weight_decay)
        data = DataIterator(self.train, s.batch_size, s.seed, shuffle=True)
        step = self.resumed_from = 0
        if start is not None:
            step = self.resumed_from = self._restore(start, model, opt, data)
            self.log(f"SFT: resumed from {start} (step {step} of {self.total})")
        self._trim_metrics(step)
        metrics = MetricsLogger(self.out / "metrics.jsonl")
        n_params = sum(p.numel() for p in model.parameters())
        n_train = sum(p.numel() for p in model.parameters() if p.requires_grad)
        self.log(f"SFT: {len(self.train)} conversations, {self.total} steps of {s.batch_size}, "
                 f"{n_train:,} of {n_params:,} parameters trained, into {self.out}")
        model.train()
        bar = tqdm(total=self.total, initial=step, desc="SFT", disable=not cfg.trainer.progress_bar, mininterval=1.0)
        losses, seconds, tokens = [], 0.0, 0.0
        val_loss = math.nan
        try:
            while step < self.total:
                t0 = time.perf_counter()
                # A run shorter than sft.warmup_steps warms up over all of it.
                lr = cosine_lr(step, self.total, s.lr, min(s.warmup_steps, self.total))
                m = sft_step(model, opt, data.next_batch(), lr, micro_batch_size=s.micro_batch_size,
                             grad_clip=s.grad_clip, compute_dtype=self.dtype, share_prefix=self.share_prefix)
                step += 1
                dt = time.perf_counter() - t0
                seconds, tokens = seconds + dt, tokens + m["tokens"]
                losses.append(m["loss"])
                record = {"sft/loss": m["loss"], "sft/lr": lr, "sft/grad_norm": m["grad_norm"],
                          "sft/tokens": m["tokens"], "sft/trained_tokens": m["trained_tokens"],
                          "sft/step_seconds": dt, "sft/tokens_per_second": m["tokens"] / max(dt, 1e-9),
                          "sft/epoch": data.epoch}
                if self.val and ((s.test_freq > 0 and step % s.test_freq == 0) or step == self.total):
                    val_loss = eval_loss(model, self.val, s.micro_batch_size or s.batch_size, self.dtype)
                    record["sft/val_loss"] = val_loss
                metrics.log(record, step)
                bar.update(1)
                postfix = {"loss": f"{m['loss']:.4f}"}
                if self.val:
                    postfix["val"] = f"{val_loss:.4f}"
                bar.set_postfix(postfix)
                if s.save_freq > 0 and step % s.save_freq == 0 and step < self.total:
                    self._save(step, model, opt, data)
        finally:
            bar.close()
            metrics.close()
        return self._finish(model, step, losses, seconds, tokens, val_loss)

    def _save(self, step: int, model: Any, opt: Any, data: Any) -> None:
        from agentloop_trainer.checkpoint.common import save_checkpoint

        save_checkpoint(self.out / "checkpoints", step, model.state_dict(), opt.state_dict(),
                        {"data": data.state(), "total_steps": self.total})

    def _restore(self, path: Path, model: Any, opt: Any, data: Any) -> int:
        from agentloop_trainer.checkpoint.common import CheckpointError, load_checkpoint, set_rng_state

        model_state, opt_state, state = load_checkpoint(path)
        if int(state.get("total_steps", self.total)) != self.total:
            raise CheckpointError(f"{path} was written by a stage of {state['total_steps']} steps, this one has "
                                  f"{self.total} (sft.total_steps, sft.epochs, sft.batch_size or the data changed); "
                                  "resume with the same settings, or start afresh with sft.resume=never")
        model.load_state_dict(model_state)
        opt.load_state_dict(opt_state)
        data.load_state(state["data"])
        set_rng_state(state["rng"])
        return int(state["step"])

    def _trim_metrics(self, step: int) -> None:
        """Keep the records of steps a resumed run does not repeat (all of them: none, afresh)."""
        path = self.out / "metrics.jsonl"
        if not path.exists():
            return
        kept = [line for line in path.read_text().splitlines() if line.strip() and json.loads(line)["step"] <= step]
        path.write_text("".join(line + "\n" for line in kept))

    def _finish(self, model: Any, step: int, losses: list[float], seconds: float, tokens: float,
                val_loss: float) -> tuple[Path, dict[str, Any]]:
        from agentloop_core.cache import build_once
        from agentloop_trainer.checkpoint.hf_folder import write_hf_folder

        cfg = self.cfg
        model.eval()
        result = self.out / RESULT_DIR

        def write(folder: Path) -> None:
            write_hf_folder(model, self.tokenizer, folder, cfg.trainer.hf_max_shard_megabytes * 2**20)

        build_once(result, write)
        history = [json.loads(line) for line in (self.out / "metrics.jsonl").read_text().splitlines() if line.strip()]
        tail = [h["sft/loss"] for h in history[-10:]]
        summary = {
            "sft_steps": step, "sft_resumed_from_step": self.resumed_from, "sft_conversations": len(self.train), "sft_dropped_overlong": self.dropped,
            "sft_val_conversations": len(self.val), "sft_dropped_overlong_val": self.dropped_val,
            "sft_first_loss": history[0]["sft/loss"] if history else None,
            "sft_final_loss": sum(tail) / len(tail) if tail else None,
            "sft_val_loss": None if math.isnan(val_loss) else val_loss,
            "sft_seconds": seconds, "sft_seconds_per_step": seconds / max(1, len(losses)),
            "sft_tokens_per_second": tokens / max(seconds, 1e-9),
            "sft_tokenize_seconds": self.tokenize_seconds,
            "sft_peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "sft_model": str(result),
        }
        (self.out / "summary.json").write_text(json.dumps(summary, indent=2))
        self.log(f"SFT: {step} steps, loss {summary['sft_first_loss']:.4f} -> {summary['sft_final_loss']:.4f}"
                 + (f", held-out loss {val_loss:.4f}" if self.val else "") + f"; model in {result}")
        return result, summary


def start_checkpoint(cfg: TrainConfig, run_dir: str | Path, log: Any = print) -> tuple[Path, dict[str, Any]]:
    """The checkpoint GRPO starts from, and what the SFT stage adds to the run's summary.

    With ``sft.train_files``: the SFT stage's result (run now, or reused when finished; a
    resumed run also resumes an unfinished stage), after a held-out eval of ``model.path``
    when ``sft.eval_before``. Else ``model.path``, or the tiny model's cached warm-up.
    """
    from agentloop_trainer.policy.tokenizer import load_tokenizer
    from agentloop_trainer.stages.sft.warmup_checkpoint import sft_checkpoint

    if not cfg.sft.train_files:
        return (Path(cfg.model.path) if cfg.model.path else sft_checkpoint(cfg, load_tokenizer(cfg.model), log)), {}
    summary: dict[str, Any] = {}
    if cfg.sft.eval_before:
        if cfg.model.path:
            from agentloop_trainer.stages.rollout_setup import evaluate_checkpoint

            before = evaluate_checkpoint(cfg, cfg.model.path)
            log(f"held-out accuracy before SFT: {before.accuracy:.3f} (n={before.n})")
            summary["eval_accuracy_before_sft"] = before.accuracy
            # The evaluation's engine (weights, key/value caches of 128 rows decoding) is closed,
            # but glibc keeps what it freed: without a trim SFT ran on top of it.
            release_host_memory()
        else:
            log("sft.eval_before: skipped, there is no model.path (the tiny model starts from random weights)")
    if cfg.trainer.resume != "never" and cfg.sft.resume == "never":
        from agentloop_trainer.config.nodes import merged_config

        cfg = merged_config(cfg, {"sft": {"resume": "auto"}})
    path, stage = run_sft(cfg, run_dir, log)
    # glibc keeps SFT's freed activations: without a trim the SFT peak (~10 GB at 16 x 318 tokens
    # on a 135M model) stayed resident and the first GRPO update was OOM-killed at 24 GB.
    release_host_memory()
    summary.update(stage)
    return path, summary
