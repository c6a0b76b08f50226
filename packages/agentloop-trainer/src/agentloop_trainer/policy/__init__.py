"""The policy a run starts from: its sections (``model``, ``sft``), its tokenizer with the run's
chat template, and the tiny model. The tiny model's SFT warm-up checkpoint is built by the SFT
stage (:mod:`agentloop_trainer.stages.sft.warmup_checkpoint`).

- :mod:`~agentloop_trainer.policy.settings`: the ``model`` and ``sft`` sections and their checks.
- :mod:`~agentloop_trainer.policy.lr_schedules`: the ``sft`` section's learning-rate schedules
  (``sft.schedule``: the registry :data:`~agentloop_trainer.policy.lr_schedules.SCHEDULES`).

- :mod:`~agentloop_trainer.policy.tokenizer`: the run's tokenizer (:func:`load_tokenizer`).
- :mod:`~agentloop_trainer.policy.chat_templates`: ``model.custom_chat_template`` on every
  tokenizer, and the start-up check that the template shows the model its tools.
- :mod:`~agentloop_trainer.policy.model`: the tiny Qwen2 policy, LoRA adapters, gradient
  checkpointing.
"""

from agentloop_trainer.policy.chat_templates import (
    TemplateIgnoresToolsError,
    apply_custom_chat_template,
    check_template_renders_tools,
    custom_chat_template,
)
from agentloop_trainer.policy.model import (
    TinyModelConfig,
    apply_lora,
    build_tiny_policy,
    enable_gradient_checkpointing,
)
from agentloop_trainer.policy.settings import ModelSection, SFTSection
from agentloop_trainer.policy.tokenizer import load_tokenizer, tokenizer_source

__all__ = [
    "ModelSection",
    "SFTSection",
    "TemplateIgnoresToolsError",
    "TinyModelConfig",
    "apply_custom_chat_template",
    "apply_lora",
    "build_tiny_policy",
    "check_template_renders_tools",
    "custom_chat_template",
    "enable_gradient_checkpointing",
    "load_tokenizer",
    "tokenizer_source",
]
