"""Per-token log-probs of sequences that hold images: one padded forward with each row's pixel
values, as the engine prefilled them.

The images are the rollout's own :class:`~agentloop_core.vision.ImageItem`\\ s (their pixel
values and grids were computed once, where each image entered its trajectory), so the trainer
feeds the vision tower exactly what the engine fed it. A model with 3-D rotary positions
(M-RoPE: the Qwen-VL family) computes them itself from ``image_grid_thw`` and
``mm_token_type_ids`` over the right-padded rows (its ``get_rope_index``), as its engine
prefill did (``agentloop_engines.adapters.hf.vision``). Rows without images in the same batch get plain
text positions.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from agentloop_core.vision.processor import ImageItem, stack_features
from agentloop_trainer.update.placeholder_mask import banned_token_ids, token_log_probs


def vision_token_id(model: Any) -> int | None:
    """The image placeholder id of a vision-language policy (plain, peft- or FSDP-wrapped), or
    None for a text-only one."""
    config = getattr(model, "config", None)
    if config is None or getattr(config, "vision_config", None) is None:
        return None
    token = getattr(config, "image_token_id", None)
    return None if token is None else int(token)


def multimodal_log_probs(model: Any, sequences: Sequence[Sequence[int]], images: Sequence[Sequence[ImageItem]],
                         temperature: float = 1.0, pad_id: int = 0, device: Any = None) -> Any:
    """Log-prob of each next token of each sequence, with its images.

    Args:
        model: A vision-language model (``*ForConditionalGeneration``), possibly wrapped.
        sequences: Unpadded prompt + response ids per row, each at least 2 long.
        images: Per row, the images whose tokens the row holds, in order (may be empty).
        temperature: Logits are divided by it.
        pad_id: Id used for right padding (never scored).
        device: Where the inputs go; None: the device of the model's first parameter.

    Returns:
        ``[B, N-1]`` (N = longest row): ``[b, t] = log p(seq_b[t+1] | seq_b[:t+1], images_b)``
        over the tokens the engines sample (placeholder ids removed); 0 past a row's end and
        where ``seq_b[t+1]`` is a placeholder.

    Raises:
        ValueError: a model without a vision tower, or a row whose image tokens are not its
            images' token counts.
    """
    import torch

    token_id = vision_token_id(model)
    if token_id is None:
        raise ValueError("rows with images need a vision-language policy (its config has a vision_config and an "
                         "image_token_id); this model is text-only")
    device = device if device is not None else next(model.parameters()).device
    B, N = len(sequences), max(len(s) for s in sequences)
    ids = torch.full((B, N), pad_id, dtype=torch.long)
    valid = torch.zeros((B, N), dtype=torch.long)
    for b, s in enumerate(sequences):
        ids[b, : len(s)] = torch.as_tensor(list(s), dtype=torch.long)
        valid[b, : len(s)] = 1
        found, expected = list(s).count(token_id), sum(item.num_tokens for item in images[b])
        if found != expected:
            raise ValueError(f"row {b} holds {found} image tokens but its {len(images[b])} image(s) fill {expected}; "
                             "a trajectory's multi_modal_data must list its images in token order")
    ids, valid = ids.to(device), valid.to(device)
    items = [item for row in images for item in row]
    kwargs: dict[str, Any] = {}
    if items:
        for key, value in stack_features(items).items():  # Idefics3's tiles: padded, one batch row
            kwargs[key] = torch.from_numpy(value).to(device)
        kwargs["mm_token_type_ids"] = ((ids == token_id) & (valid == 1)).to(torch.int32)
    logits = model(input_ids=ids, attention_mask=valid, use_cache=False, **kwargs).logits
    # The engines' distribution: placeholder ids removed; the image tokens (targets here, mask 0
    # in the loss) score 0 rather than -inf. The last position predicts nothing (not scored).
    picked = token_log_probs(logits, ids[:, 1:], banned_token_ids(model), temperature)
    return picked * valid[:, 1:]
