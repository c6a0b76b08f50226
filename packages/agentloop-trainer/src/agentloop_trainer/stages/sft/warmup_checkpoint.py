"""The tiny model's starting point: its SFT warm-up checkpoint on the calculator task's
demonstrations, built once per setting and cached on disk."""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path
from typing import Any

from agentloop_trainer.config.sections import TrainConfig
from agentloop_trainer.config_base import plain_dict
from agentloop_trainer.policy.chat_templates import custom_chat_template
from agentloop_trainer.policy.settings import SFTSection

TASK_VERSION = "calc-v1"
"""Version of the calculator task's demonstrations, part of the cache key."""

WARMUP_KEYS = ("steps", "stop_loss", "max_steps", "batch_size", "lr", "warmup_steps", "flip_prob", "seed")
"""``sft`` keys the warm-up checkpoint depends on."""
LATER_WARMUP_KEYS = ("weight_decay", "grad_clip", "micro_batch_size", "schedule", "exit_loss", "cooldown_steps")
"""``sft`` keys the warm-up also reads, in its cache key only when they differ from the default."""


def sft_cache_key(cfg: TrainConfig) -> str:
    """A short hash of everything the SFT checkpoint depends on."""
    section = plain_dict(cfg.sft, "sft", resolve=False)
    # The keys the warm-up had when the cache was keyed on the whole section, always; the
    # warm-up's later keys only when set, so a default config keeps its cached checkpoint; the
    # general stage's keys (sft.train_files...) never, since the warm-up does not read them.
    sft = {k: section[k] for k in WARMUP_KEYS}
    defaults = SFTSection()
    sft.update({k: section[k] for k in LATER_WARMUP_KEYS if section[k] != getattr(defaults, k)})
    spec = {"task": TASK_VERSION, "sft": sft, "train_seed": cfg.data.train_seed, "train_size": cfg.data.train_size}
    template = custom_chat_template(cfg.model)
    if template is not None:  # the demonstrations are rendered with it (unset: the keys of older caches)
        spec["chat_template"] = hashlib.sha256(template.encode()).hexdigest()
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:12]


def sft_checkpoint(cfg: TrainConfig, tokenizer: Any, log: Any = print) -> Path:
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
        from tqdm import tqdm

        from agentloop_trainer.policy.lr_schedules import make_schedule
        from agentloop_trainer.policy.model import build_tiny_policy
        from agentloop_trainer.stages.sft import STOP_WINDOW, learned, train_sft, window_mean
        from agentloop_trainer.task.calculator import BIASED_TEMPLATES, make_problems

        s = cfg.sft
        model = build_tiny_policy(tokenizer, seed=s.seed).to(cfg.trainer.device)
        problems = make_problems(cfg.data.train_size, cfg.data.train_seed)
        start = time.perf_counter()
        section = SFTSection(**plain_dict(s, "sft"))
        schedule = make_schedule(section)
        log(f"training the SFT warm-up checkpoint ({schedule.plan()}) into {target}")
        bar = tqdm(total=schedule.planned_steps, desc="SFT warm-up", disable=not cfg.trainer.progress_bar,
                   mininterval=2.0)

        def progress(step: int, loss: float) -> None:
            bar.update(1)
            if step % 50 == 0:
                bar.set_postfix(loss=f"{loss:.3f}")

        losses = train_sft(model, tokenizer, problems, section, tuple(BIASED_TEMPLATES), progress, schedule)
        bar.close()
        mean = window_mean(losses)
        if not learned(losses, s.stop_loss):
            log(f"WARNING: the SFT warm-up did not learn the demonstrations in {len(losses)} steps (mean loss "
                f"of the last {STOP_WINDOW} steps {mean:.4f} >= sft.stop_loss={s.stop_loss}); the held-out "
                "accuracy before RL will be low. Raise sft.max_steps or try another sft.seed")
        elif (outcome := schedule.outcome()) is not None:
            log(f"SFT warm-up {outcome}; mean loss of the last {STOP_WINDOW} steps {mean:.4f}")
        model.cpu().save_pretrained(out)
        tokenizer.save_pretrained(out)
        (out / "sft_info.json").write_text(json.dumps({
            "steps": len(losses), "schedule": s.schedule, "schedule_steps": s.steps, "max_steps": s.max_steps,
            "stop_loss": s.stop_loss,
            "seconds": time.perf_counter() - start,
            "final_loss": mean, "torch_threads": torch.get_num_threads(),
        }, indent=2))

    return build_once(target, build)
