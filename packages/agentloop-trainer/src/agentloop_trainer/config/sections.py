"""The training config: OmegaConf structured defaults with verl-familiar names, composed from
the sections each trainer room declares (``data/settings.py``, ``policy/settings.py``,
``rollout/settings.py``, ``reward/settings.py``, ``update/settings.py``, ``loggers/settings.py``).

``agentloop train key=value ...`` overrides any leaf. An unknown or mistyped key is an error
that names the key and the closest valid one, never a silently ignored setting.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from agentloop_trainer.config.actor_rollout_ref import ActorRolloutRefSection
from agentloop_trainer.data.settings import DataSection
from agentloop_trainer.loggers.settings import LoggingSection
from agentloop_trainer.policy.settings import ModelSection, SFTSection
from agentloop_trainer.reward.settings import CustomRewardFunctionSection, RewardModelSection, RewardSection
from agentloop_trainer.rollout.settings import RaySection
from agentloop_trainer.update.critic_settings import CriticSection
from agentloop_trainer.update.distill_settings import DistillationSection
from agentloop_trainer.update.settings import AlgorithmSection

__all__ = [
    "AlgorithmSection", "CustomRewardFunctionSection", "DataSection", "ModelSection", "RaySection", "RewardSection",
    "SFTSection", "TrainConfig", "TrainerSection",
]


@dataclass
class TrainerSection(LoggingSection):
    """Run control (verl: ``trainer``); its logger keys are the loggers' own section
    (:class:`~agentloop_trainer.loggers.settings.LoggingSection`)."""

    total_steps: int = 20
    """GRPO steps (verl: ``total_training_steps``; 20 keep the default job near 3 minutes on 2 CPU
    cores, its held-out gain made by step 10; the H200 runs in the README used 50)."""
    seed: int = 0
    """Seed of data order, sampling and the engine."""
    experiment_name: str | None = None
    """Run name: outputs go to ``<output_dir>/<experiment_name>``; None: a timestamp. Also the
    MLflow and W&B run name."""
    output_dir: str = "outputs"
    """Parent folder of runs."""
    run_dir: str | None = None
    """The run folder itself (verl: ``default_local_dir``); null: ``<output_dir>/<experiment_name>``."""
    fsdp_ranks: int = 1
    """Trainer processes (FSDP2 over gloo on CPU, NCCL on GPU); 1: no sharding."""
    launcher: str = "spawn"
    """How FSDP ranks start: spawn (processes on this machine) or ray (actors in a placement
    group, possibly on several nodes)."""
    device: str = "cpu"
    """cpu or cuda."""
    host_mmap_threshold_mb: int | None = None
    """On a CPU trainer, map host allocations of at least this many MB (1-32) from the OS and
    unmap them when freed (glibc's ``M_MMAP_THRESHOLD``, fixed for the process and each FSDP
    rank; ``agentloop train``, ``sft`` and ``eval`` all read it): decoding batches' logits and
    key/value tensors, whose sizes drift step by step, then leave no holes in the heap. Less
    memory for more time: one evaluation of the real-model
    recipe peaked at 5.5 GB instead of 8.1 but took 121 s instead of 87 (each fresh block is
    faulted in); the recipe's GRPO phase peaked at 8.0 GB instead of 11.9 (bench/README 10g). null:
    glibc's adaptive threshold. Not glibc, or trainer.device=cuda: unused."""
    test_freq: int = 10
    """Evaluate every validation set every this many steps (0 or -1: only before and after):
    ``eval/accuracy`` plus ``val/<data_source>/{pass@k,avg@k,maj@k}`` with standard errors
    (``/se``), logged to every logger in ``trainer.logger``."""
    val_before_train: bool = True
    """Evaluate before the first step."""
    save_freq: int = 25
    """Checkpoint every this many steps (0 or -1: never)."""
    save_hf: bool = True
    """At each checkpoint, also write the policy as a Hugging Face folder
    (``checkpoints/step_<N>/hf``: config, safetensors weights with LoRA merged, tokenizer),
    loadable by transformers, vLLM and ``agentloop eval``."""
    hf_max_shard_megabytes: int = 5000
    """Split the Hugging Face folder's weights into files of at most this many megabytes, listed
    in ``model.safetensors.index.json`` (``save_pretrained``'s ``max_shard_size``)."""
    resume: str = "never"
    """never: start from step 0; must (``--resume``): continue from the run's latest checkpoint
    and fail if it has none; auto (``--resume-or-start``): continue if there is one, else start.
    true and false are read as must and never."""
    progress_bar: bool = True
    """Show a tqdm bar."""
    log_trajectories_per_step: int = 4
    """Sample trajectories written each step to ``<run>/trajectories/step_<N>.jsonl`` (the format of
    ``agentloop rollout``; ``agentloop view <run>`` renders them); failed ones are always written."""
    mode: str = "sync"
    """sync: each step rolls out its batch, then trains (the default) | one_step_off: the rollout
    of the next batch overlaps the update, generations finish on the weights they started on
    (max_staleness 1) | async: rollout runs continuously into a bounded buffer, and a weight
    update interrupts generations at a token boundary and resumes them on the new weights
    (partial rollout). The async modes support the hf and vllm engines (in process, on Ray, or
    behind rollout.server_urls), not sglang."""
    critic_warmup: int = 0
    """With ``algorithm.adv_estimator=gae``: the first this many steps train only the critic
    (the policy stays as it is while the value model learns the reward's scale)."""
    max_staleness: int | None = None
    """Most policy versions between the start of a GRPO group and the step that trains it; null:
    0 for sync, 1 for one_step_off and async. The rollout pauses when a new group could exceed it."""


@dataclass
class TrainConfig:
    """Everything ``agentloop train`` reads."""

    data: DataSection = field(default_factory=DataSection)
    model: ModelSection = field(default_factory=ModelSection)
    sft: SFTSection = field(default_factory=SFTSection)
    actor_rollout_ref: ActorRolloutRefSection = field(default_factory=ActorRolloutRefSection)
    algorithm: AlgorithmSection = field(default_factory=AlgorithmSection)
    custom_reward_function: CustomRewardFunctionSection = field(default_factory=CustomRewardFunctionSection)
    reward: RewardSection = field(default_factory=RewardSection)
    reward_model: RewardModelSection = field(default_factory=RewardModelSection)
    trainer: TrainerSection = field(default_factory=TrainerSection)
    ray: RaySection = field(default_factory=RaySection)
    distillation: DistillationSection = field(default_factory=DistillationSection)
    critic: CriticSection = field(default_factory=CriticSection)
