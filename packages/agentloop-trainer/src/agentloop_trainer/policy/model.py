"""The tiny policy model: a 2-layer Qwen2 sized for the calculator task on a CPU."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class TinyModelConfig:
    """Shape of the tiny Qwen2 policy."""

    hidden_size: int = 128
    """Width of the residual stream (96 and 64 were tried for a faster warm-up: bench/README 10c)."""
    num_hidden_layers: int = 2
    """Transformer blocks."""
    num_attention_heads: int = 4
    """Query heads of 32 dimensions (and key/value heads: no grouped-query attention at this size)."""
    intermediate_size: int = 512
    """Width of the MLP."""
    max_position_embeddings: int = 1024
    """Longest sequence (prompt plus response)."""


def build_tiny_policy(tokenizer: Any, seed: int = 0, spec: TinyModelConfig | None = None) -> Any:
    """A freshly initialised ``Qwen2ForCausalLM`` with tied embeddings for ``tokenizer``.

    Args:
        tokenizer: Hugging Face tokenizer; its full length (added tokens included) sets the vocab.
        seed: Initialisation seed.
        spec: Model shape; the calibrated default when None.

    Returns:
        The model in float32, in train mode.

    Raises:
        ValueError: ``spec.num_attention_heads`` does not divide ``spec.hidden_size``.
    """
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    spec = spec or TinyModelConfig()
    if spec.num_attention_heads < 1 or spec.hidden_size % spec.num_attention_heads:
        raise ValueError(f"TinyModelConfig: num_attention_heads={spec.num_attention_heads} does not divide "
                         f"hidden_size={spec.hidden_size}; give heads that do (e.g. "
                         f"{max(1, spec.hidden_size // 32)} heads of {spec.hidden_size // max(1, spec.hidden_size // 32)})")
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
    # pyright's ignore: transformers wraps PreTrainedModel.to in functools.wraps, which typeshed types
    # as an unbound callable (the dtype lands on ``self``).
    model = Qwen2ForCausalLM(config).to(torch.float32)  # pyright: ignore[reportArgumentType]
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model


def apply_lora(model: Any, rank: int, alpha: int, target_modules: Any = "all-linear") -> Any:
    """Wrap ``model`` with LoRA adapters (peft): only the adapters train afterwards.

    Args:
        model: A transformers causal LM.
        rank: Adapter rank (``model.lora_rank``).
        alpha: Scaling numerator (``model.lora_alpha``).
        target_modules: Module names or ``"all-linear"`` (``model.target_modules``).

    Raises:
        ImportError: peft is not installed (names the extra that brings it).
        ValueError: no module matches ``target_modules`` (names the model's linear modules).
    """
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError:
        raise ImportError("model.lora_rank > 0 needs peft: pip install 'agentloop-trainer[lora]'") from None
    import torch

    targets = target_modules if isinstance(target_modules, str) else list(target_modules)
    try:
        return get_peft_model(model, LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, lora_dropout=0.0,
                                                bias="none", task_type="CAUSAL_LM"))
    except ValueError as exc:
        linear = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)})
        raise ValueError(f"model.target_modules={targets!r} matches no module of {type(model).__name__} ({exc}); "
                         f"its linear modules are {linear}, or use all-linear") from None


def use_cpu_matmul(model: Any, cpu_matmul: str, device: str) -> int:
    """``model.cpu_matmul``: with ``onednn`` on a CPU run, the policy's linear layers multiply
    on oneDNN (:mod:`agentloop_trainer.policy.onednn_linear`); returns how many layers."""
    if cpu_matmul != "onednn" or not str(device).startswith("cpu"):
        return 0
    from agentloop_trainer.policy.onednn_linear import use_onednn_linears

    return use_onednn_linears(model)


def enable_gradient_checkpointing(model: Any) -> None:
    """Recompute each decoder layer's activations in the backward pass (non-reentrant, so
    frozen embeddings under LoRA still pass gradients)."""
    from agentloop_trainer.update.weights import unwrap_policy

    base = unwrap_policy(model)
    kwargs = {"use_reentrant": False}
    if hasattr(base, "activation_checkpointing_enable"):  # transformers >= 5.2x
        base.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
