"""The policy a run starts from: its tokenizer with the run's chat template, the tiny model, and
the tiny model's SFT warm-up checkpoint.

- :mod:`~agentloop_trainer.policy.tokenizer`: the run's tokenizer (:func:`load_tokenizer`).
- :mod:`~agentloop_trainer.policy.chat_templates`: ``model.custom_chat_template`` on every
  tokenizer, and the start-up check that the template shows the model its tools.
- :mod:`~agentloop_trainer.policy.model`: the tiny Qwen2 policy, LoRA adapters, gradient
  checkpointing.
- :mod:`~agentloop_trainer.policy.warmup_checkpoint`: the tiny model's warm-up checkpoint,
  built once and cached.
"""

from agentloop_trainer.policy.chat_templates import (
    TemplateIgnoresToolsError,
    apply_custom_chat_template,
    check_template_renders_tools,
)
from agentloop_trainer.policy.model import (
    TinyModelConfig,
    apply_lora,
    build_tiny_policy,
    enable_gradient_checkpointing,
)
from agentloop_trainer.policy.tokenizer import load_tokenizer, tokenizer_source
from agentloop_trainer.policy.warmup_checkpoint import (
    LATER_WARMUP_KEYS,
    TASK_VERSION,
    WARMUP_KEYS,
    sft_cache_key,
    sft_checkpoint,
)

__all__ = [
    "LATER_WARMUP_KEYS",
    "TASK_VERSION",
    "TemplateIgnoresToolsError",
    "TinyModelConfig",
    "WARMUP_KEYS",
    "apply_custom_chat_template",
    "apply_lora",
    "build_tiny_policy",
    "check_template_renders_tools",
    "enable_gradient_checkpointing",
    "load_tokenizer",
    "sft_cache_key",
    "sft_checkpoint",
    "tokenizer_source",
]
