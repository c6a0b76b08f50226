"""The policy's sections: ``model`` (verl: ``actor_rollout_ref.model``) and ``sft`` (how the
policy's starting checkpoint is fine-tuned: the general SFT stage and the tiny model's warm-up),
and their checks."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from agentloop_trainer.config_base import require
from agentloop_trainer.policy.lr_schedules import SCHEDULES
from agentloop_trainer.policy.precision import AUTO


@dataclass
class ModelSection:
    """The policy (verl: ``actor_rollout_ref.model``)."""

    path: str | None = None
    """Hugging Face checkpoint folder to start GRPO from; None: build the tiny model and its
    SFT warm-up checkpoint (cached on disk)."""
    tokenizer_path: str | None = None
    """Tokenizer folder; None: the model folder, or the tiny tokenizer."""
    custom_chat_template: str | None = None
    """The chat template every tokenizer of the run gets (trainer, loops, Ray workers, engines,
    exported folders): a built-in name (``chatml-hermes``, ``llama3-json``), a path to a Jinja
    file, or the template text; None: the tokenizer's own. Set it when the model's template
    ignores ``tools=``."""
    dtype: str = "float32"
    """Parameters and compute of the trained policy: float32 | bfloat16 | auto. bfloat16 is mixed
    precision: master weights, gradient reduction and optimizer state stay float32 (FSDP2
    gathers bfloat16 parameters; one process computes under autocast). auto: bfloat16 where
    ``trainer.device`` computes it natively (a CUDA GPU that supports it, a CPU with AVX512_BF16
    or AMX), float32 elsewhere, where autocast is slower than float32; resolved when the config
    is loaded (:mod:`agentloop_trainer.policy.precision`), so the run's config.yaml records it."""
    enable_gradient_checkpointing: bool = False
    """Recompute each decoder layer's activations in the backward pass instead of keeping them."""
    cpu_matmul: str = "onednn"
    """Who multiplies the policy's float32 linear layers on the CPU (forward and backward):
    ``onednn`` (``agentloop_trainer.policy.onednn_linear``; over twice MKL's speed on AMD CPUs,
    gradients equal to ~1e-6 relative) or ``torch`` (torch's own, MKL's sgemm in the CPU
    wheels). Other devices and dtypes always use torch's own."""
    lora_rank: int = 0
    """LoRA rank (peft); 0: train every weight. With LoRA only the adapters train, engines get
    merged weights, and the KL reference is the base model with the adapter disabled."""
    lora_alpha: int = 16
    """LoRA scaling numerator (the update is scaled by lora_alpha / lora_rank)."""
    target_modules: Any = "all-linear"
    """Modules that get adapters: a list of names (``[q_proj, v_proj]``) or ``all-linear``."""


@dataclass
class SFTSection:
    """Supervised fine-tuning: the general stage (``sft.train_files``: ``agentloop sft``, or
    the first stage of ``agentloop train``) and the tiny model's warm-up on (biased) teacher
    demonstrations (no ``model.path``, no ``sft.train_files``). Keys shared by both: batch_size,
    micro_batch_size, lr, warmup_steps, weight_decay, grad_clip, seed."""

    steps: int = 750
    """Warm-up: optimizer steps of the learning-rate schedule (linear warm-up, cosine decay to 10%)."""
    stop_loss: float | None = 0.02
    """Warm-up: the demonstrations count as learned when the mean loss of the schedule's last 50
    steps is below this (the teacher's coin flips on the biased templates keep it above ~0.005).
    When they are not, the schedule runs again from the start (a warm restart), up to
    ``max_steps`` in all: how long the loss sits on a plateau before it falls varies
    several-fold with the seed, so one fixed length is either slow for most seeds or too short
    for some. null: run the schedule once."""
    max_steps: int = 1500
    """Warm-up: most optimizer steps in all (``cosine_restarts``: whole schedules only)."""
    schedule: str = "cosine_restarts"
    """Warm-up: the learning-rate schedule
    (:mod:`~agentloop_trainer.policy.lr_schedules`). ``cosine_restarts``: ``steps`` steps of
    linear warm-up and cosine decay, run again from the start while not learned (``stop_loss``).
    ``wsd``: warm-up, then the peak rate until the loss leaves its plateau (``exit_loss``), then
    a ``cooldown_steps`` decay, stopping as soon as learned; it ends at ``max_steps`` (with a
    ``stop_loss``) or ``steps`` (without) at the latest. ``wsd`` learned seeds 0 and 1 in fewer
    steps but not seed 2 in 1500 (2026-12-06, the trainer's README), so it is not the default."""
    exit_loss: float = 0.1
    """Warm-up, ``wsd``: the loss has left its plateau (~0.2-0.5) when the mean of the last 25
    steps is below this; the cooldown starts there."""
    cooldown_steps: int = 200
    """Warm-up, ``wsd``: steps of the cosine decay from the peak rate to 10% after the plateau
    (it starts earlier on the plateau when it would otherwise pass the step cap)."""
    batch_size: int = 32
    """Conversations per optimizer step."""
    lr: float = 3e-3
    """Peak learning rate (linear warm-up, cosine decay to 10%). The default is the tiny
    model's; a pretrained checkpoint wants ~1e-5 (full) or ~1e-4 (LoRA)."""
    warmup_steps: int = 50
    """Warm-up steps of the learning-rate schedule (of each run of it, for the tiny warm-up)."""
    flip_prob: float = 0.6
    """Warm-up: chance the teacher flips the last operator on a biased template."""
    seed: int = 0
    """Seed of the model init (tiny model), the data order, the demonstration stream and the
    teacher's mistakes."""
    train_files: Any = None
    """SFT conversations: a parquet or jsonl file, or a list of them, in verl's multi-turn SFT
    layout (a ``messages`` column; assistant messages may carry OpenAI ``tool_calls``; ``tool``
    messages hold the results; optional ``tools``: a list of JSON schemas or a JSON string of
    one). Set, ``agentloop train`` first fine-tunes ``model.path`` (or the tiny model) on them
    into ``<run>/sft/`` and runs GRPO from the result. ``agentloop data calculator-sft`` writes
    such a file for the calculator task."""
    val_files: Any = None
    """Held-out SFT conversations (same layout): their loss is logged as ``sft/val_loss``."""
    epochs: int = 1
    """Passes over ``train_files`` (when ``total_steps`` is null)."""
    total_steps: int | None = None
    """Optimizer steps of the general stage; null: ``epochs`` passes over the data (a partial
    batch at an epoch's end is dropped)."""
    micro_batch_size: int | None = None
    """Conversations per forward/backward; gradients accumulate over ``batch_size``. null: the
    whole batch at once."""
    max_length: int = 2048
    """Longest conversation in tokens (chat template and tool schemas included)."""
    filter_overlong: bool = True
    """Drop conversations longer than ``max_length`` (the count is logged and kept in the
    summary); false: a longer one is an error naming the row."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    grad_clip: float = 1.0
    """Max global gradient norm."""
    save_freq: int = 0
    """Checkpoint (weights, optimizer state, step, data position) every this many steps into
    ``<sft>/checkpoints/``; 0: never (the final Hugging Face folder is always written)."""
    test_freq: int = 0
    """Held-out loss every this many steps (0: only at the end); needs ``val_files``."""
    output_dir: str | None = None
    """The stage's folder; null: ``<run>/sft`` (the run folder as ``agentloop train`` names it).
    The fine-tuned model lands in ``<folder>/hf``."""
    resume: str = "never"
    """never | auto | must (``agentloop sft --resume``): continue from the stage's latest
    checkpoint. Under ``agentloop train`` a finished stage (``<sft>/hf``) is always reused."""
    eval_before: bool = False
    """``agentloop train`` with ``train_files``: also evaluate ``model.path`` on the held-out
    split before SFT (``eval_accuracy_before_sft`` in summary.json; after SFT is GRPO's
    ``eval_accuracy_before``)."""



TRAIN_DTYPES = ("float32", "bfloat16", AUTO)
"""Values of ``model.dtype`` (``auto`` is resolved to one of the others when the config is loaded)."""

CPU_MATMULS = ("onednn", "torch")
"""Values of ``model.cpu_matmul`` (:mod:`agentloop_trainer.policy.onednn_linear`)."""


def check(model: ModelSection, sft: SFTSection) -> None:
    """Range and choice checks of ``model`` and ``sft`` (the chat template's name is resolved by
    :func:`~agentloop_trainer.policy.chat_templates.custom_chat_template`).

    Raises:
        ConfigError: naming the key and what it must be.
    """
    require([
        ("model.dtype", model.dtype in TRAIN_DTYPES,
         f"one of {TRAIN_DTYPES} (float16 needs loss scaling, which agentloop does not do: use bfloat16)"),
        ("model.lora_rank", model.lora_rank >= 0, ">= 0 (0: train every weight)"),
        ("model.cpu_matmul", model.cpu_matmul in CPU_MATMULS, f"one of {CPU_MATMULS}"),
        ("model.lora_alpha", model.lora_alpha > 0, "> 0"),
        ("sft.batch_size", sft.batch_size >= 1, "at least 1"),
        ("sft.micro_batch_size", sft.micro_batch_size is None or 1 <= sft.micro_batch_size <= sft.batch_size,
         "null or between 1 and sft.batch_size"),
        ("sft.epochs", sft.epochs >= 1, "at least 1"),
        ("sft.total_steps", sft.total_steps is None or sft.total_steps >= 1, "null or at least 1"),
        ("sft.max_length", sft.max_length >= 2, "at least 2"),
        ("sft.resume", sft.resume in ("never", "auto", "must"), "never, auto or must"),
        ("sft.schedule", sft.schedule in SCHEDULES, " or ".join(SCHEDULES)),
        ("sft.cooldown_steps", sft.cooldown_steps >= 1, "at least 1"),
    ])
