"""What the vision tests compare an engine against: the log-probs a trainer computes with one
full forward of prompt + generation (the model's own positions), and the largest gap."""

from __future__ import annotations

import torch


def full_forward_log_probs(model, processor, ids: list[int], items, generated: list[int],
                           banned: tuple[int, ...] = ()) -> list[float]:
    """What a trainer computes for a Qwen-VL model: one forward of prompt + generation; with
    ``banned`` ids, over the other tokens only (what vLLM's ``processed_logprobs`` report when
    those ids are banned from sampling)."""
    x = torch.tensor([ids + generated])
    kwargs = {}
    if items:
        inputs = processor.model_inputs(items)
        kwargs = {"pixel_values": torch.from_numpy(inputs["pixel_values"]),
                  "image_grid_thw": torch.from_numpy(inputs["image_grid_thw"]),
                  "mm_token_type_ids": (x == processor.image_token_id).int()}
    with torch.no_grad():
        logits = model(input_ids=x, attention_mask=torch.ones_like(x), **kwargs).logits[0].float()
    if banned:
        logits[:, list(banned)] = float("-inf")
    lp = torch.log_softmax(logits, -1)
    n = len(ids)
    return [lp[n - 1 + j, t].item() for j, t in enumerate(generated)]


def gap(a: list[float] | None, b: list[float] | None) -> float:
    """The largest absolute difference of two log-prob lists of one length."""
    assert a is not None
    assert b is not None
    return max(abs(x - y) for x, y in zip(a, b, strict=True))
