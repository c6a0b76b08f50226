"""What HFServer reads off the model it serves at start-up: the dtype a name means and the ids
that end a generation."""

from __future__ import annotations

from typing import Any

import torch

from agentloop_engines.adapters.hf.vision import text_config

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
"""The dtype names HFServer accepts."""


def torch_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    """``dtype`` as a ``torch.dtype`` (None stays None: the model's own).

    Raises:
        ValueError: an unknown name, naming the valid ones.
    """
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {sorted(DTYPES)}")
    return DTYPES[dtype]


def eos_token_ids(model: Any, tokenizer: Any) -> tuple[int, ...]:
    """Every id that ends a generation: the generation config's, the model config's and the
    tokenizer's EOS, in that order, without repeats."""
    ids: list[int] = []
    gen_cfg = getattr(model, "generation_config", None)
    config = text_config(model)
    for source in (getattr(gen_cfg, "eos_token_id", None), getattr(config, "eos_token_id", None)):
        if source is not None:
            ids.extend([source] if isinstance(source, int) else list(source))
    if tokenizer is not None and getattr(tokenizer, "eos_token_id", None) is not None:
        ids.append(tokenizer.eos_token_id)
    return tuple(dict.fromkeys(int(i) for i in ids))
