"""The training config: OmegaConf structured defaults with verl-familiar names.

``agentloop train key=value ...`` overrides any leaf. An unknown or mistyped key is an error
that names the key and the closest valid one, never a silently ignored setting.
"""

from __future__ import annotations

import difflib
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class DataSection:
    """Datasets (verl: ``data``)."""

    train_files: str | None = None
    """Parquet file of training rows; None: the synthetic calculator task."""
    val_files: str | None = None
    """Parquet file of held-out rows; None: the synthetic calculator task."""
    train_size: int = 20000
    """Synthetic training problems."""
    val_size: int = 200
    """Synthetic held-out problems."""
    train_seed: int = 1
    """Seed of the synthetic training split."""
    val_seed: int = 2
    """Seed of the synthetic held-out split (disjoint questions from training are enforced)."""
    train_batch_size: int = 16
    """Prompts per GRPO step."""
    max_prompt_length: int = 512
    """Longest prompt in tokens, counted with the chat template and the rollout's tool schemas."""
    filter_overlong_prompts: bool = True
    """Drop longer prompts (the count is logged and kept in summary.json); false: a longer
    prompt is an error naming the row."""
    max_response_length: int = 128
    """Token budget of a response (generated + tool tokens)."""
    shuffle: bool = True
    """Shuffle training rows each epoch."""


@dataclass
class ModelSection:
    """The policy (verl: ``actor_rollout_ref.model``)."""

    path: str | None = None
    """Hugging Face checkpoint folder to start GRPO from; None: build the tiny model and its
    SFT warm-up checkpoint (cached on disk)."""
    tokenizer_path: str | None = None
    """Tokenizer folder; None: the model folder, or the tiny tokenizer."""


@dataclass
class SFTSection:
    """SFT warm-up of the tiny model on (biased) teacher demonstrations."""

    steps: int = 1500
    """Optimizer steps."""
    batch_size: int = 32
    """Conversations per step."""
    lr: float = 3e-3
    """Peak learning rate (cosine)."""
    warmup_steps: int = 100
    """Warm-up steps."""
    flip_prob: float = 0.6
    """Chance the teacher flips the last operator on a biased template."""
    seed: int = 0
    """Seed of the model init, the demonstration stream and the teacher's mistakes."""


@dataclass
class ActorSection:
    """GRPO actor (verl: ``actor_rollout_ref.actor``)."""

    lr: float = 1e-4
    """AdamW learning rate."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    clip_ratio_low: float = 0.2
    """PPO ratio floor is 1 - this."""
    clip_ratio_high: float = 0.2
    """PPO ratio ceiling is 1 + this."""
    grad_clip: float = 1.0
    """Max global gradient norm."""
    loss_agg_mode: str = "token-mean"
    """token-mean | seq-mean-token-mean | seq-mean-token-sum."""
    use_kl_loss: bool = False
    """Add a k3 KL term to a frozen reference policy."""
    kl_loss_coef: float = 0.001
    """Weight of the KL term."""
    tis_cap: float | None = 2.0
    """Cap of the rollout-vs-trainer importance weight; null disables the correction."""
    ppo_epochs: int = 1
    """Passes over each batch."""
    ppo_mini_batch_size: int | None = None
    """Samples per optimizer step; null: one update per batch."""


@dataclass
class MultiTurnSection:
    """Multi-turn limits (verl: ``rollout.multi_turn``)."""

    max_assistant_turns: int = 3
    """Most model turns per trajectory."""
    max_tokens_per_turn: int = 64
    """Most tokens one assistant turn may generate."""


@dataclass
class AgentSection:
    """Agent loop workers (verl: ``rollout.agent``)."""

    num_workers: int = 1
    """Workers a batch is split over."""


@dataclass
class RolloutSection:
    """Rollout (verl: ``actor_rollout_ref.rollout``)."""

    n: int = 8
    """Samples per prompt (GRPO group size)."""
    temperature: float = 1.0
    """Sampling temperature."""
    top_k: int = 0
    """0 disables top-k."""
    top_p: float = 1.0
    """1.0 disables nucleus sampling."""
    max_batch_size: int = 128
    """Requests the engine decodes together."""
    backend: str = "inprocess"
    """inprocess: one engine and the rollout workers in the trainer process (fastest on one small
    machine); ray: engine replicas and rollout workers as Ray actors (set by ``ray.address``)."""
    num_replicas: int = 1
    """Engine replicas (ray backend), each in its own placement-group bundle."""
    free_cache_engine: bool = True
    """Put engines that support it to sleep (weights and KV cache off the GPU) during the
    update, and wake them before the weight sync."""
    sanity_check: str = "ignore_strippable"
    """Delta-tokenization check: strict | ignore_strippable | disable."""
    multi_turn: MultiTurnSection = field(default_factory=MultiTurnSection)
    """Multi-turn limits."""
    agent: AgentSection = field(default_factory=AgentSection)
    """Agent loop workers."""


@dataclass
class ActorRolloutRefSection:
    """Actor, rollout and reference (verl layout)."""

    actor: ActorSection = field(default_factory=ActorSection)
    """The trained policy."""
    rollout: RolloutSection = field(default_factory=RolloutSection)
    """The rollout engine and loop."""


@dataclass
class AlgorithmSection:
    """Advantage estimation (verl: ``algorithm``)."""

    adv_estimator: str = "grpo"
    """grpo (mean/std per group) | dr_grpo (mean only)."""


@dataclass
class RaySection:
    """Ray cluster and placement (used when ``rollout.backend=ray``)."""

    address: str | None = None
    """Cluster to join: ``auto``, ``ray://host:10001`` or ``host:6379`` (setting it selects the ray
    backend); None: start a local Ray cluster on this machine."""
    num_cpus: int | None = None
    """CPUs of a local cluster; None: all of this machine's."""
    placement_strategy: str = "PACK"
    """PACK | SPREAD | STRICT_PACK | STRICT_SPREAD for engine replicas and FSDP ranks."""
    replica_num_cpus: float = 1.0
    """CPUs each engine replica reserves."""
    replica_num_gpus: float = 0.0
    """GPUs each engine replica reserves (its tensor-parallel size on GPU engines)."""
    worker_placement: str = "spread"
    """spread: rollout workers round-robin over alive nodes (soft affinity); default: Ray decides."""
    rank_num_cpus: float = 1.0
    """CPUs each FSDP rank reserves (``trainer.launcher=ray``)."""
    rank_num_gpus: float = 0.0
    """GPUs each FSDP rank reserves (``trainer.launcher=ray``)."""


@dataclass
class TrainerSection:
    """Run control (verl: ``trainer``)."""

    total_steps: int = 30
    """GRPO steps (30 keep the default job under 15 minutes on 2 CPU cores; the H200 runs in
    the README used 50)."""
    seed: int = 0
    """Seed of data order, sampling and the engine."""
    experiment_name: str | None = None
    """Run name: outputs go to ``<output_dir>/<experiment_name>``; None: a timestamp."""
    output_dir: str = "outputs"
    """Parent folder of runs."""
    fsdp_ranks: int = 1
    """Trainer processes (FSDP2 over gloo on CPU, NCCL on GPU); 1: no sharding."""
    launcher: str = "spawn"
    """How FSDP ranks start: spawn (processes on this machine) or ray (actors in a placement
    group, possibly on several nodes)."""
    device: str = "cpu"
    """cpu or cuda."""
    test_freq: int = 10
    """Evaluate on the held-out split every this many steps (0: only before and after)."""
    save_freq: int = 25
    """Checkpoint every this many steps (0: never)."""
    resume: bool = False
    """Resume from the latest checkpoint of this run."""
    mlflow_tracking_uri: str | None = None
    """Also log metrics to MLflow at this URI (e.g. sqlite:///mlflow.db)."""
    progress_bar: bool = True
    """Show a tqdm bar."""


@dataclass
class TrainConfig:
    """Everything ``agentloop train`` reads."""

    data: DataSection = field(default_factory=DataSection)
    model: ModelSection = field(default_factory=ModelSection)
    sft: SFTSection = field(default_factory=SFTSection)
    actor_rollout_ref: ActorRolloutRefSection = field(default_factory=ActorRolloutRefSection)
    algorithm: AlgorithmSection = field(default_factory=AlgorithmSection)
    trainer: TrainerSection = field(default_factory=TrainerSection)
    ray: RaySection = field(default_factory=RaySection)


class ConfigError(ValueError):
    """A config key or value is wrong; the message names it and the fix."""


def _leaf_keys(node: Any, prefix: str = "") -> list[str]:
    from omegaconf import DictConfig

    keys = []
    for k in node.keys():
        path = f"{prefix}{k}"
        child = node._get_node(k)
        if isinstance(child, DictConfig):
            keys.append(path)
            keys.extend(_leaf_keys(child, path + "."))
        else:
            keys.append(path)
    return keys


def _check_key(key: str, valid: list[str]) -> None:
    if key in valid:
        return
    close = difflib.get_close_matches(key, valid, n=1, cutoff=0.5)
    if not close:
        # Match on the last component too: "rollout.temprature" -> "...rollout.temperature".
        tail = key.rsplit(".", 1)[-1]
        tails = {v.rsplit(".", 1)[-1]: v for v in valid}
        near = difflib.get_close_matches(tail, list(tails), n=1)
        close = [tails[near[0]]] if near else []
    hint = f"; did you mean {close[0]!r}?" if close else ""
    raise ConfigError(f"unknown config key {key!r}{hint} (see `agentloop train --show-config` for all keys)")


def load_config(overrides: Sequence[str] = (), config_file: str | Path | None = None) -> Any:
    """Build the config from defaults, an optional YAML file, then ``key=value`` overrides.

    Args:
        overrides: Dotted ``key=value`` strings, e.g. ``actor_rollout_ref.rollout.n=4``.
        config_file: YAML file merged over the defaults.

    Returns:
        A read-only OmegaConf ``DictConfig`` typed by :class:`TrainConfig`.

    Raises:
        ConfigError: an unknown key (naming the closest valid one), a malformed override, or a
            value of the wrong type.
    """
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    cfg = OmegaConf.structured(TrainConfig)
    valid = _leaf_keys(cfg)
    layers = []
    if config_file is not None:
        loaded = OmegaConf.load(str(config_file))
        for key in _leaf_keys(loaded):
            _check_key(key, valid)
        layers.append(loaded)
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not key=value (e.g. trainer.total_steps=20)")
        key = item.split("=", 1)[0].strip().lstrip("+")
        _check_key(key, valid)
    try:
        if overrides:
            layers.append(OmegaConf.from_dotlist([o.lstrip("+") for o in overrides]))
        cfg = OmegaConf.merge(cfg, *layers)
    except OmegaConfBaseException as exc:
        raise ConfigError(f"bad config value: {exc}".strip()) from None
    validate(cfg)
    OmegaConf.set_readonly(cfg, True)
    return cfg


def validate(cfg: Any) -> None:
    """Range and choice checks that types cannot express.

    Raises:
        ConfigError: naming the key.
    """
    from agentloop_trainer.algos import ADV_ESTIMATORS, LOSS_AGG_MODES

    checks = [
        ("algorithm.adv_estimator", cfg.algorithm.adv_estimator in ADV_ESTIMATORS, f"one of {ADV_ESTIMATORS}"),
        ("actor_rollout_ref.actor.loss_agg_mode", cfg.actor_rollout_ref.actor.loss_agg_mode in LOSS_AGG_MODES,
         f"one of {LOSS_AGG_MODES}"),
        ("actor_rollout_ref.rollout.n", cfg.actor_rollout_ref.rollout.n >= 1, "at least 1 (2+ for GRPO)"),
        ("data.train_batch_size", cfg.data.train_batch_size >= 1, "at least 1"),
        ("trainer.total_steps", cfg.trainer.total_steps >= 0, ">= 0"),
        ("trainer.fsdp_ranks", cfg.trainer.fsdp_ranks >= 1, "at least 1"),
        ("trainer.device", cfg.trainer.device in ("cpu", "cuda"), "cpu or cuda"),
        ("trainer.launcher", cfg.trainer.launcher in ("spawn", "ray"), "spawn or ray"),
        ("actor_rollout_ref.rollout.backend", cfg.actor_rollout_ref.rollout.backend in ("inprocess", "ray"),
         "inprocess or ray"),
        ("actor_rollout_ref.rollout.num_replicas", cfg.actor_rollout_ref.rollout.num_replicas >= 1, "at least 1"),
        ("actor_rollout_ref.rollout.num_replicas",
         cfg.actor_rollout_ref.rollout.num_replicas == 1 or uses_ray(cfg),
         "1 with the inprocess backend (set actor_rollout_ref.rollout.backend=ray or ray.address for more)"),
        ("ray.placement_strategy", cfg.ray.placement_strategy in ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"),
         "one of PACK, SPREAD, STRICT_PACK, STRICT_SPREAD"),
        ("ray.worker_placement", cfg.ray.worker_placement in ("spread", "default"), "spread or default"),
    ]
    for key, ok, expected in checks:
        if not ok:
            raise ConfigError(f"config {key} must be {expected}")


def uses_ray(cfg: Any) -> bool:
    """Whether the rollout runs on Ray: ``rollout.backend=ray`` or a ``ray.address`` to join."""
    return cfg.actor_rollout_ref.rollout.backend == "ray" or cfg.ray.address is not None


def to_yaml(cfg: Any) -> str:
    """The config as YAML (for ``--show-config`` and the run folder)."""
    from omegaconf import OmegaConf

    return OmegaConf.to_yaml(cfg)
