"""A tiny randomly initialised Qwen2 causal LM next to the tiny tokenizer, for tests and demos.

The folder is an ordinary Hugging Face checkpoint: ``AutoModelForCausalLM.from_pretrained`` and
``AutoTokenizer.from_pretrained`` load it, so every engine adapter (HF, vLLM) can serve it.
It is built on this machine (nothing is downloaded) and cached under
``agentloop_core.cache.cache_dir()``.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Any

from agentloop_core.cache import build_once, cache_dir
from agentloop_core.testing.tiny_tokenizer import tiny_tokenizer_path

TINY_MODEL_VERSION = "v1"

_DEFAULTS = {
    "seed": 0,
    "hidden_size": 128,
    "num_layers": 2,
    "num_heads": 4,
    "num_kv_heads": 2,
    "intermediate_size": 512,
    "max_position_embeddings": 2048,
    "initializer_range": 0.02,
}


def _require_hf():
    try:
        import torch
        import transformers
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError(
            'the tiny model needs torch and transformers: pip install "agentloop-engines[hf]"'
        ) from exc
    return torch, transformers


def save_seeded_model(model_class: Any, config: Any, *, seed: int, eos_id: int, pad_id: int, out_dir: Path) -> None:
    """Initialise ``model_class(config)`` from ``seed`` (the global RNG seeded only around init:
    a fork keeps callers' RNG state untouched), give its generation config the tokenizer's EOS
    and pad ids and no BOS, and save it to ``out_dir``. The tiny text and vision models' one way
    to turn a config into a checkpoint."""
    import torch

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_class(config)
    model.generation_config.eos_token_id = eos_id
    model.generation_config.pad_token_id = pad_id
    model.generation_config.bos_token_id = None
    model.save_pretrained(str(out_dir))


def _build(out_dir: Path, spec: dict[str, float]) -> None:
    torch, transformers = _require_hf()
    tok_dir = tiny_tokenizer_path()
    # Copy the tokenizer files byte for byte (not re-saved) so ids cannot drift; the model's
    # own config.json replaces the tokenizer folder's placeholder.
    for item in tok_dir.iterdir():
        if item.is_file() and item.name not in {"config.json", ".complete"}:
            shutil.copy2(item, out_dir / item.name)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(tok_dir))
    eos_id = tokenizer.convert_tokens_to_ids(tokenizer.eos_token)
    pad_id = tokenizer.convert_tokens_to_ids(tokenizer.pad_token)
    config = transformers.Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=spec["hidden_size"],
        intermediate_size=spec["intermediate_size"],
        num_hidden_layers=spec["num_layers"],
        num_attention_heads=spec["num_heads"],
        num_key_value_heads=spec["num_kv_heads"],
        max_position_embeddings=spec["max_position_embeddings"],
        initializer_range=spec["initializer_range"],
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        use_cache=True,
    )
    save_seeded_model(transformers.Qwen2ForCausalLM, config, seed=int(spec["seed"]), eos_id=eos_id, pad_id=pad_id,
                      out_dir=out_dir)
    (out_dir / "agentloop_tiny_model.json").write_text(json.dumps({"version": TINY_MODEL_VERSION, **spec}))


def build_tiny_model(
    path: Path | str | None = None,
    *,
    seed: int = 0,
    hidden_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 512,
    max_position_embeddings: int = 2048,
    initializer_range: float = 0.02,
) -> Path:
    """Build (once) a tiny random Qwen2ForCausalLM with the tiny tokenizer and return its folder.

    Args:
        path: Where to build it. None: ``cache_dir()/tiny-qwen2-<version>`` for the default
            shape, with a short hash of the arguments appended for any other shape or seed.
        seed: Seed of the random initialisation.
        hidden_size: Model width.
        num_layers: Number of decoder layers.
        num_heads: Attention heads (must divide ``hidden_size``).
        num_kv_heads: Key/value heads for grouped-query attention (must divide ``num_heads``).
        intermediate_size: MLP width.
        max_position_embeddings: Context length the config declares.
        initializer_range: Std of the random weights. The default suits training; tests use a
            larger one (e.g. 0.3) so random greedy outputs vary with the prompt.

    Returns:
        A folder loadable by ``AutoModelForCausalLM`` and ``AutoTokenizer``.

    Raises:
        ValueError: on inconsistent head counts.
        ImportError: without torch/transformers (``pip install "agentloop-engines[hf]"``).
    """
    if num_heads < 1 or hidden_size % num_heads:
        raise ValueError(f"num_heads={num_heads} must divide hidden_size={hidden_size}")
    if num_kv_heads < 1 or num_heads % num_kv_heads:
        raise ValueError(f"num_kv_heads={num_kv_heads} must divide num_heads={num_heads}")
    spec = {
        "seed": seed,
        "hidden_size": hidden_size,
        "num_layers": num_layers,
        "num_heads": num_heads,
        "num_kv_heads": num_kv_heads,
        "intermediate_size": intermediate_size,
        "max_position_embeddings": max_position_embeddings,
        "initializer_range": initializer_range,
    }
    if path is None:
        name = f"tiny-qwen2-{TINY_MODEL_VERSION}"
        if spec != _DEFAULTS:
            name += "-" + hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:10]
        path = cache_dir() / name
    return build_once(Path(path), lambda out: _build(out, spec))
