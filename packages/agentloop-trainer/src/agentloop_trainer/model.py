"""The tiny policy model: a 2-layer Qwen2 sized for the calculator task on a CPU."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class TinyModelSpec:
    """Shape of the tiny Qwen2 policy."""

    hidden_size: int = 128
    """Width of the residual stream."""
    num_hidden_layers: int = 2
    """Transformer blocks."""
    num_attention_heads: int = 4
    """Query heads (and key/value heads: no grouped-query attention at this size)."""
    intermediate_size: int = 512
    """Width of the MLP."""
    max_position_embeddings: int = 1024
    """Longest sequence (prompt plus response)."""


def build_tiny_policy(tokenizer: Any, seed: int = 0, spec: TinyModelSpec | None = None) -> Any:
    """A freshly initialised ``Qwen2ForCausalLM`` with tied embeddings for ``tokenizer``.

    Args:
        tokenizer: Hugging Face tokenizer; its full length (added tokens included) sets the vocab.
        seed: Initialisation seed.
        spec: Model shape; the calibrated default when None.

    Returns:
        The model in float32, in train mode.
    """
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    spec = spec or TinyModelSpec()
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_attention_heads,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        use_cache=True,
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config).to(torch.float32)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model
