"""One way to build a GRPO trainer from a config: the CLI (one process) and every FSDP rank
(spawned or on Ray) call :func:`build_trainer`, so they seed, load and shard the same way;
:func:`run_fsdp_training` launches the ranks."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

from agentloop_trainer.config.sections import TrainConfig
from agentloop_trainer.stages.memory import map_large_host_blocks


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch (the engine and sampling seeds derive from the config)."""
    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def load_policy_tokenizer(cfg: TrainConfig, model_path: str | Path) -> Any:
    """The tokenizer a run trains with: ``model.tokenizer_path``, else the checkpoint's, with
    ``model.custom_chat_template`` applied."""
    from agentloop_trainer.policy.tokenizer import load_tokenizer

    return load_tokenizer(cfg.model, model_path)


def needs_engine_copy(cfg: TrainConfig) -> bool:
    """Whether the trainer hands the engine an in-memory copy of the policy: an engine in this
    process whose plug-in declares ``capabilities.policy_copy`` (hf; the others, Ray replicas and
    remote servers load the checkpoint themselves)."""
    from agentloop_trainer.rollout.settings import engine_plugin, uses_ray

    r = cfg.actor_rollout_ref.rollout
    return not r.server_urls and not uses_ray(r, cfg.ray) and engine_plugin(r).capabilities.policy_copy


def build_trainer(cfg: TrainConfig, model_path: str | Path, run_dir: str | Path, log: Any = print, *, rank: int = 0,
                  world_size: int = 1, tokenizer: Any = None, stats: dict[str, int] | None = None) -> Any:
    """The :class:`~agentloop_trainer.stages.grpo.PolicyGradientTrainer` for ``cfg``, on one process or as one
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

    from agentloop_engines.adapters.hf.vision import load_model
    from agentloop_trainer.policy.model import apply_lora, enable_gradient_checkpointing, use_cpu_matmul
    from agentloop_trainer.stages.grpo import PolicyGradientTrainer
    from agentloop_trainer.stages.rollout_setup import run_records
    from agentloop_trainer.update.settings import offload_enabled, reference_offloaded

    seed_everything(cfg.trainer.seed)
    device = cfg.trainer.device
    m = cfg.model
    tokenizer = tokenizer if tokenizer is not None else load_policy_tokenizer(cfg, model_path)
    # Master weights are float32 whatever model.dtype says: the optimizer steps them.
    model = load_model(str(model_path), torch.float32)
    if m.enable_gradient_checkpointing:
        enable_gradient_checkpointing(model)
    if m.lora_rank > 0:
        model = apply_lora(model, m.lora_rank, m.lora_alpha, m.target_modules)
    use_cpu_matmul(model, m.cpu_matmul, device)
    arr = cfg.actor_rollout_ref
    offload, ref_offload = offload_enabled(arr.actor), reference_offloaded(arr.actor, arr.ref, m.lora_rank)
    owns_group = False
    if world_size == 1 and (offload or ref_offload):
        # Offload is FSDP2's: one process shards over a one-rank group of its own.
        import torch.distributed as dist

        if not dist.is_initialized():
            from agentloop_trainer.update.fsdp import free_port, init_process_group

            init_process_group(0, 1, free_port(), device)
            owns_group = True
    ref = None
    if world_size > 1 or offload:
        from agentloop_trainer.update.fsdp import shard_policy

        # pyright's ignore: PreTrainedModel.to is typed without binding self (see policy.model).
        model = shard_policy(model if offload else model.to(device), device, m.dtype, offload)  # pyright: ignore[reportArgumentType]
    # With LoRA the reference is the policy with its adapters disabled: no second copy.
    if cfg.actor_rollout_ref.actor.use_kl_loss and m.lora_rank == 0 and (world_size > 1 or ref_offload):
        from agentloop_trainer.update.fsdp import load_reference

        ref = load_reference(model_path, device, m.dtype, ref_offload)
        use_cpu_matmul(ref, m.cpu_matmul, device)  # as the policy: equal weights give a KL of exactly 0
    engine_model = None
    if rank == 0 and needs_engine_copy(cfg):
        engine_model = load_model(str(model_path), torch.float32)
    train, test = run_records(cfg, tokenizer, log if rank == 0 else None, stats)
    trainer = PolicyGradientTrainer(cfg, model, engine_model, tokenizer, train, test, Path(run_dir), log=log,
                          model_path=model_path, ref_model=ref)
    trainer.owns_process_group = owns_group
    return trainer


def _train_rank(rank: int, cfg_yaml: str, model_path: str, run_dir: str) -> dict[str, Any]:
    import torch.distributed as dist

    from agentloop_trainer.config.accessors import uses_ray
    from agentloop_trainer.config.nodes import config_from_yaml

    cfg = config_from_yaml(cfg_yaml)
    # A process of its own: the driver's allocator setting does not carry over.
    map_large_host_blocks(cfg.trainer)
    if rank == 0 and uses_ray(cfg):
        from agentloop_engines.fleet.hosting import connect_ray

        connect_ray(cfg.ray.address, listen_on_network=cfg.ray.listen_on_network)  # the driver's cluster
    trainer = build_trainer(cfg, model_path, run_dir, log=print if rank == 0 else (lambda *_: None), rank=rank,
                            world_size=dist.get_world_size())
    try:
        return trainer.fit()
    finally:
        trainer.close()


def run_fsdp_training(cfg: TrainConfig, model_path: str | Path, run_dir: str | Path, launcher: str = "spawn", *,
                      num_cpus_per_rank: float = 1.0, num_gpus_per_rank: float | None = None,
                      strategy: str = "PACK", placement_group: Any = None) -> dict[str, Any]:
    """Run GRPO on ``cfg.trainer.fsdp_ranks`` ranks; returns rank 0's summary.

    Args:
        cfg: The training config.
        model_path: Checkpoint every rank loads.
        run_dir: Output directory (written by rank 0, on rank 0's node).
        launcher: ``"spawn"``: processes on this machine; ``"ray"``: Ray actors in a placement
            group (:func:`agentloop_trainer.update.ray_ranks.spawn_ray`; Ray must be initialised).
        num_cpus_per_rank: CPUs per rank (``"ray"`` only).
        num_gpus_per_rank: GPUs per rank (``"ray"`` only); None: 1 when
            ``cfg.trainer.device`` is cuda, else 0.
        strategy: Placement strategy, PACK or SPREAD (or STRICT_*) (``"ray"`` only).
        placement_group: A ready placement group to use instead of creating one (``"ray"`` only).

    Raises:
        ValueError: on an unknown launcher.
    """
    from omegaconf import OmegaConf

    args = (OmegaConf.to_yaml(cfg), str(model_path), str(run_dir))
    world_size, device = int(cfg.trainer.fsdp_ranks), cfg.trainer.device
    if launcher == "spawn":
        from agentloop_trainer.update.fsdp import spawn

        return spawn(_train_rank, world_size, *args, device=device)
    if launcher == "ray":
        from agentloop_trainer.update.ray_ranks import spawn_ray

        gpus = (1.0 if device == "cuda" else 0.0) if num_gpus_per_rank is None else num_gpus_per_rank
        return spawn_ray(_train_rank, world_size, *args, device=device, num_cpus_per_rank=num_cpus_per_rank,
                         num_gpus_per_rank=gpus, strategy=strategy, placement_group=placement_group)
    raise ValueError(f"unknown launcher {launcher!r}; use 'spawn' (processes on this machine) or 'ray' "
                     "(Ray actors, possibly on several nodes)")
