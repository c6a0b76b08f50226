"""Supervised fine-tuning: a stage any model can run (``agentloop sft``, or the first stage of
``agentloop train``), and the tiny model's warm-up as one use of it.

- :mod:`~agentloop_trainer.stages.sft.data`: verl's multi-turn SFT rows (parquet, jsonl), checked.
- :mod:`~agentloop_trainer.stages.sft.tokenize`: conversations as the ids and mask a rollout holds.
- :mod:`~agentloop_trainer.stages.sft.loss`: the loss, one optimizer step (the learning-rate
  schedules are the ``sft`` section's: :mod:`~agentloop_trainer.policy.lr_schedules`).
- :mod:`~agentloop_trainer.stages.sft.stage`: the general training loop (resumable, LoRA, bf16).
- :mod:`~agentloop_trainer.stages.sft.warmup`: the tiny model's warm-up driver.

The calculator task's demonstrations as SFT rows are the task's
(:mod:`~agentloop_trainer.task.demonstrations`).
"""

from agentloop_trainer.policy.lr_schedules import cosine_lr
from agentloop_trainer.stages.sft.data import (
    SFTDataError,
    SFTExample,
    parse_row,
    read_sft_files,
    write_calculator_sft,
    write_sft_rows,
)
from agentloop_trainer.stages.sft.loss import eval_loss, make_optimizer, sft_loss, sft_step
from agentloop_trainer.stages.sft.tokenize import SFTTokenizer, TokenizedConversation, tokenize_conversation
from agentloop_trainer.stages.sft.warmup import (
    STOP_WINDOW,
    SFTConfig,
    demonstration_batch,
    learned,
    train_sft,
    window_mean,
)

__all__ = [
    "STOP_WINDOW",
    "SFTConfig",
    "SFTDataError",
    "SFTExample",
    "SFTTokenizer",
    "TokenizedConversation",
    "cosine_lr",
    "demonstration_batch",
    "eval_loss",
    "learned",
    "make_optimizer",
    "parse_row",
    "read_sft_files",
    "sft_loss",
    "sft_step",
    "tokenize_conversation",
    "train_sft",
    "window_mean",
    "write_calculator_sft",
    "write_sft_rows",
]
