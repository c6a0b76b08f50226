"""What a run starts from: the tokenizer, the SFT warm-up checkpoint (built once and cached on
disk) and the train/held-out datasets."""

from __future__ import annotations

import hashlib
import json
import logging
import time
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

TASK_VERSION = "calc-v1"


def load_tokenizer(cfg: Any, checkpoint: str | Path | None = None) -> Any:
    """The run's tokenizer: ``model.tokenizer_path``, else ``checkpoint``'s, else
    ``model.path``'s, else the tiny tokenizer; with ``model.custom_chat_template`` as its chat
    template when that is set (every tokenizer a run loads comes from here)."""
    from transformers import AutoTokenizer

    from agentloop_trainer.chat_templates import apply_custom_chat_template

    path = cfg.model.tokenizer_path or checkpoint or cfg.model.path
    if path:
        tokenizer = AutoTokenizer.from_pretrained(str(path))
    else:
        from agentloop_core.testing import load_tiny_tokenizer

        tokenizer = load_tiny_tokenizer()
    return apply_custom_chat_template(cfg, tokenizer)


def tokenizer_source(cfg: Any, checkpoint: str | Path | None = None) -> str:
    """Where :func:`load_tokenizer` reads the tokenizer from, for messages."""
    return str(cfg.model.tokenizer_path or checkpoint or cfg.model.path or "the tiny tokenizer")


WARMUP_KEYS = ("steps", "stop_loss", "max_steps", "batch_size", "lr", "warmup_steps", "flip_prob", "seed")
"""``sft`` keys the warm-up checkpoint depends on."""
LATER_WARMUP_KEYS = ("weight_decay", "grad_clip", "micro_batch_size")
"""``sft`` keys the warm-up also reads, in its cache key only when they differ from the default."""


def sft_cache_key(cfg: Any) -> str:
    """A short hash of everything the SFT checkpoint depends on."""
    from omegaconf import OmegaConf

    from agentloop_trainer.config import SFTSection, custom_chat_template

    section = OmegaConf.to_container(cfg.sft)
    # The keys the warm-up had when the cache was keyed on the whole section, always; the
    # warm-up's later keys only when set, so a default config keeps its cached checkpoint; the
    # general stage's keys (sft.train_files...) never, since the warm-up does not read them.
    sft = {k: section[k] for k in WARMUP_KEYS}
    defaults = SFTSection()
    sft.update({k: section[k] for k in LATER_WARMUP_KEYS if section[k] != getattr(defaults, k)})
    spec = {"task": TASK_VERSION, "sft": sft, "train_seed": cfg.data.train_seed, "train_size": cfg.data.train_size}
    template = custom_chat_template(cfg)
    if template is not None:  # the demonstrations are rendered with it (unset: the keys of older caches)
        spec["chat_template"] = hashlib.sha256(template.encode()).hexdigest()
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:12]


def sft_checkpoint(cfg: Any, tokenizer: Any, log: Any = print) -> Path:
    """The SFT warm-up checkpoint for ``cfg``, trained now unless a cached one exists.

    Returns:
        A Hugging Face checkpoint folder (model + tokenizer).
    """
    from agentloop_core.cache import build_once, cache_dir

    target = cache_dir() / f"sft-{TASK_VERSION}-{sft_cache_key(cfg)}"
    if (target / ".complete").exists():
        log(f"reusing SFT checkpoint {target}")
        return target

    def build(out: Path) -> None:
        import torch
        from omegaconf import OmegaConf
        from tqdm import tqdm

        from agentloop_trainer.model import build_tiny_policy
        from agentloop_trainer.sft import STOP_WINDOW, SFTConfig, learned, train_sft, window_mean
        from agentloop_trainer.task import BIASED_TEMPLATES, make_problems

        s = cfg.sft
        model = build_tiny_policy(tokenizer, seed=s.seed).to(cfg.trainer.device)
        problems = make_problems(cfg.data.train_size, cfg.data.train_seed)
        start = time.perf_counter()
        bar = tqdm(total=s.steps, desc="SFT warm-up", disable=not cfg.trainer.progress_bar, mininterval=2.0)

        def progress(step: int, loss: float) -> None:
            bar.update(1)
            if step % 50 == 0:
                bar.set_postfix(loss=f"{loss:.3f}")

        losses = train_sft(model, tokenizer, problems,
                           SFTConfig(**OmegaConf.to_container(s, resolve=True)),
                           tuple(BIASED_TEMPLATES), progress)
        bar.close()
        mean = window_mean(losses)
        if not learned(losses, s.stop_loss):
            log(f"WARNING: the SFT warm-up did not learn the demonstrations in {len(losses)} steps (mean loss "
                f"of the last {STOP_WINDOW} steps {mean:.4f} >= sft.stop_loss={s.stop_loss}); the held-out "
                "accuracy before RL will be low. Raise sft.max_steps or try another sft.seed")
        elif len(losses) > s.steps:
            log(f"SFT warm-up learned the demonstrations after {len(losses)} steps ({len(losses) // s.steps} runs "
                f"of the schedule; mean loss of the last {STOP_WINDOW} steps {mean:.4f})")
        model.cpu().save_pretrained(out)
        tokenizer.save_pretrained(out)
        (out / "sft_info.json").write_text(json.dumps({
            "steps": len(losses), "schedule_steps": s.steps, "max_steps": s.max_steps, "stop_loss": s.stop_loss,
            "seconds": time.perf_counter() - start,
            "final_loss": mean, "torch_threads": torch.get_num_threads(),
        }, indent=2))

    log(f"training the SFT warm-up checkpoint ({cfg.sft.steps} steps, up to {cfg.sft.max_steps} if not learned) "
        f"into {target}")
    return build_once(target, build)


def load_records(cfg: Any, tokenizer: Any = None, log: Any = None,
                 stats: dict[str, int] | None = None) -> tuple[list[dict], list[dict]]:
    """Train and held-out rows: from parquet files when configured, else the synthetic task.

    Held-out synthetic problems whose question also occurs in training are dropped and
    replaced, so the held-out accuracy measures generalisation. With a ``tokenizer``, parquet
    prompts longer than ``data.max_prompt_length`` (rendered with the rollout's tool schemas)
    are dropped with a count (logged, and put in ``stats`` under ``data/dropped_overlong_train``
    and ``data/dropped_overlong_val``), or rejected when ``data.filter_overlong_prompts`` is false.
    """
    if cfg.data.train_files or cfg.data.val_files:
        if not (cfg.data.train_files and cfg.data.val_files):
            raise ValueError("set both data.train_files and data.val_files, or neither (the built-in task)")
        from agentloop_trainer.data import limit_prompt_length, read_parquet_files
        from agentloop_trainer.rollout import tool_schemas

        need_truth = cfg.reward.source != "loop"
        train = read_parquet_files(cfg.data.train_files, "data.train_files", need_ground_truth=need_truth)
        test = read_parquet_files(cfg.data.val_files, "data.val_files", need_ground_truth=need_truth)
        if tokenizer is not None:
            schemas = tool_schemas(cfg)
            out = []
            for name, key, rows in (("data.train_files", "train", train), ("data.val_files", "val", test)):
                kept, dropped = limit_prompt_length(rows, tokenizer, schemas, cfg.data.max_prompt_length,
                                                    cfg.data.filter_overlong_prompts, name)
                if stats is not None:
                    stats[f"data/dropped_overlong_{key}"] = dropped
                if dropped and log is not None:
                    log(f"{name}: dropped {dropped} of {len(rows)} prompts longer than "
                        f"data.max_prompt_length={cfg.data.max_prompt_length} tokens")
                if not kept:
                    raise ValueError(f"{name}: every prompt is longer than data.max_prompt_length="
                                     f"{cfg.data.max_prompt_length}; raise it")
                out.append(kept)
            train, test = out
        return train, test
    from agentloop_trainer.task import dataset_row, make_problems

    train = make_problems(cfg.data.train_size, cfg.data.train_seed)
    seen = {p.question for p in train}
    test, seed = [], cfg.data.val_seed
    while len(test) < cfg.data.val_size:
        fresh = [p for p in make_problems(cfg.data.val_size * 2, seed) if p.question not in seen]
        test.extend(fresh[: cfg.data.val_size - len(test)])
        seed += 1_000_003
    return [dataset_row(p, "train") for p in train], [dataset_row(p, "test") for p in test]
