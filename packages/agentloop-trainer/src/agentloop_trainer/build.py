"""One way to build a GRPO trainer from a config: the CLI (one process) and every FSDP rank
(spawned or on Ray) call :func:`build_trainer`, so they seed, load and shard the same way."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch (the engine and sampling seeds derive from the config)."""
    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def load_policy_tokenizer(cfg: Any, model_path: str | Path) -> Any:
    """The tokenizer a run trains with: ``model.tokenizer_path``, else the checkpoint's."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(cfg.model.tokenizer_path or model_path))


def needs_engine_copy(cfg: Any) -> bool:
    """Whether the trainer hands the engine an in-memory copy of the policy: the hf engine in
    this process (vLLM/SGLang, Ray replicas and remote servers load the checkpoint themselves)."""
    from agentloop_trainer.config import uses_ray

    r = cfg.actor_rollout_ref.rollout
    return r.name == "hf" and not r.server_urls and not uses_ray(cfg)


def build_trainer(cfg: Any, model_path: str | Path, run_dir: str | Path, log: Any = print, *, rank: int = 0,
                  world_size: int = 1, tokenizer: Any = None, stats: dict[str, int] | None = None) -> Any:
    """The :class:`~agentloop_trainer.trainer.GRPOTrainer` for ``cfg``, on one process or as one
    FSDP rank (the process group must already be joined when ``world_size > 1``).

    Args:
        cfg: The training config.
        model_path: The starting checkpoint.
        run_dir: The run folder.
        log: Console printer (rank 0).
        rank: This process's rank.
        world_size: Number of FSDP ranks.
        tokenizer: An already loaded tokenizer (else the checkpoint's).
        stats: Receives the data loading counts (dropped overlong prompts).
    """
    import torch
    from transformers import AutoModelForCausalLM

    from agentloop_trainer.assets import load_records
    from agentloop_trainer.trainer import GRPOTrainer

    seed_everything(cfg.trainer.seed)
    device = cfg.trainer.device
    tokenizer = tokenizer if tokenizer is not None else load_policy_tokenizer(cfg, model_path)
    model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch.float32)
    ref = None
    if world_size > 1:
        from agentloop_trainer.fsdp import load_reference, shard_policy

        model = shard_policy(model.to(device), device)
        if cfg.actor_rollout_ref.actor.use_kl_loss:
            ref = load_reference(model_path, device)
    engine_model = None
    if rank == 0 and needs_engine_copy(cfg):
        engine_model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch.float32)
    train, test = load_records(cfg, tokenizer, log if rank == 0 else None, stats)
    return GRPOTrainer(cfg, model, engine_model, tokenizer, train, test, Path(run_dir), log=log,
                       model_path=model_path, ref_model=ref)
