"""The run's tokenizer: from ``model.tokenizer_path``, the checkpoint, ``model.path`` or the
tiny tokenizer, with ``model.custom_chat_template`` set on it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from agentloop_trainer.policy.chat_templates import apply_custom_chat_template
from agentloop_trainer.policy.settings import ModelSection


def load_tokenizer(model: ModelSection, checkpoint: str | Path | None = None) -> Any:
    """The run's tokenizer: ``model.tokenizer_path``, else ``checkpoint``'s, else
    ``model.path``'s, else the tiny tokenizer; with ``model.custom_chat_template`` as its chat
    template when that is set (every tokenizer a run loads comes from here)."""
    from transformers import AutoTokenizer

    path = model.tokenizer_path or checkpoint or model.path
    if path:
        tokenizer = AutoTokenizer.from_pretrained(str(path))
    else:
        from agentloop_core.testing import load_tiny_tokenizer

        tokenizer = load_tiny_tokenizer()
    return apply_custom_chat_template(model, tokenizer)


def tokenizer_source(model: ModelSection, checkpoint: str | Path | None = None) -> str:
    """Where :func:`load_tokenizer` reads the tokenizer from, for messages."""
    return str(model.tokenizer_path or checkpoint or model.path or "the tiny tokenizer")
