"""Trajectories with images: the trainer's log-probs (pixel values from the rollout's own
ImageItems, the model's M-RoPE positions) equal HFServer's on the same weights, on a trajectory
with an image in the prompt and images in two tool results, batched with a text-only one; in
float32, under bfloat16 autocast, and through LoRA adapters."""

from __future__ import annotations

import asyncio

import pytest

torch = pytest.importorskip("torch")
Image = pytest.importorskip("PIL.Image")

from agentloop_core.batch import RolloutBatch  # noqa: E402
from agentloop_core.tokenization import ChatRenderer, Trajectory  # noqa: E402
from agentloop_core.vision import load_vision_processor, multi_modal_kwargs  # noqa: E402
from agentloop_engines.adapters.hf.server import HFServer  # noqa: E402
from agentloop_engines.testing.tiny_vlm import build_tiny_vlm  # noqa: E402
from agentloop_trainer.update import policy_batch_from_rollout, response_log_probs  # noqa: E402

TOOLS = [{"type": "function", "function": {"name": "zoom", "description": "Crop the image.",
                                           "parameters": {"type": "object", "properties": {}}}}]


def _picture(w: int, h: int, seed: int):
    import numpy as np

    return Image.fromarray((np.random.RandomState(seed).rand(h, w, 3) * 255).astype("uint8"))


@pytest.fixture(scope="module")
def rollout():
    return _rollout("qwen2_vl")


def _rollout(family: str):
    """Two trajectories sampled by HFServer at temperature 1: one with an image in the prompt
    and in two tool results, one text only; and the served model."""
    path = build_tiny_vlm(family=family, initializer_range=0.3)
    server = HFServer(path)
    renderer = ChatRenderer(server.tokenizer, tools=TOOLS, vision=load_vision_processor(path, server.tokenizer))
    with_images = Trajectory(renderer, [{"role": "user", "content": [
        {"type": "image", "image": _picture(150, 100, 1)}, {"type": "text", "text": "What is in the corner?"}]}],
        sanity_check="strict")
    text_only = Trajectory(renderer, [{"role": "user", "content": "Count to three."}], sanity_check="strict")

    async def turn(t: Trajectory, k: int) -> None:
        out = await server.generate(f"r{id(t)}", t.context_ids, {"max_tokens": 8, "seed": k},
                                    **multi_modal_kwargs(t.image_items))
        t.append_generated(out)

    async def run() -> None:
        for k in range(3):
            await asyncio.gather(turn(with_images, k), turn(text_only, 10 + k))
            if k < 2:
                with_images.append_messages([{"role": "tool", "name": "zoom", "content": [
                    {"type": "text", "text": "Zoomed:"}, {"type": "image", "image": _picture(60 + 30 * k, 60, 2 + k)}]}])
                text_only.append_messages([{"role": "user", "content": "Go on."}])

    asyncio.run(run())
    outputs = [with_images.to_output(sanity_check="strict"), text_only.to_output(sanity_check="strict")]
    return server.model, outputs, renderer.vision


def _gaps(model, outputs, **kwargs) -> tuple[float, float]:
    batch = RolloutBatch.from_outputs(outputs, pad_token_id=0)
    pb = policy_batch_from_rollout(batch)
    with torch.no_grad():
        logp = response_log_probs(model, pb, **kwargs)
    mask = pb.response_mask.bool()
    gap = (logp - pb.rollout_log_probs).abs()[mask]
    return float(gap.max()), float(gap.mean())


def test_the_rollout_holds_images_in_the_prompt_and_two_tool_results_with_mask_0(rollout):
    _, outputs, processor = rollout
    items = outputs[0].multi_modal_data["image"]
    assert len(items) == 3
    assert outputs[1].multi_modal_data is None
    pad = processor.image_token_id
    assert outputs[0].response_ids.count(pad) == items[1].num_tokens + items[2].num_tokens
    assert all(m == 0 for t, m in zip(outputs[0].response_ids, outputs[0].response_mask, strict=True) if t == pad)


def test_trainer_log_probs_equal_the_engines_on_a_trajectory_with_images(rollout):
    model, outputs, _ = rollout
    worst, mean = _gaps(model, outputs)
    print(f"float32: max gap {worst:.2e}, mean gap {mean:.2e}")
    assert worst < 1e-4


def test_trainer_log_probs_equal_the_engines_on_idefics3_tiles():
    """Idefics3 (SmolVLM): each image is several runs of image tokens, its tiles stacked as the
    model's one batch row of images (``stack_features``), plain 1-D positions."""
    model, outputs, processor = _rollout("idefics3")
    assert type(processor).__name__ == "Idefics3Processor"
    data = outputs[0].multi_modal_data
    assert data is not None
    assert all(len(item.run_lengths) > 1 for item in data["image"])
    worst, _ = _gaps(model, outputs)
    assert worst < 1e-4


def test_without_the_images_the_trainer_would_disagree(rollout):
    """The check above can fail: the same ids scored without pixel values are far off."""
    model, outputs, _ = rollout
    pb = policy_batch_from_rollout(RolloutBatch.from_outputs(outputs, pad_token_id=0))
    pb.images = None
    with torch.no_grad():
        logp = response_log_probs(model, pb, share_prefix=False)
    gap = (logp - pb.rollout_log_probs).abs()[pb.response_mask.bool()]
    assert float(gap.max()) > 1e-2


def test_bfloat16_autocast_stays_close(rollout):
    model, outputs, _ = rollout
    with torch.autocast("cpu", dtype=torch.bfloat16):
        worst, mean = _gaps(model, outputs)
    print(f"bfloat16 autocast: max gap {worst:.2e}, mean gap {mean:.2e}")
    assert mean < 0.05


def test_lora_adapters_at_init_leave_the_log_probs_and_train_through_images(rollout):
    pytest.importorskip("peft")
    import copy

    from agentloop_trainer.policy.model import apply_lora

    model, outputs, _ = rollout
    lora = apply_lora(copy.deepcopy(model), 4, 8)
    worst, _ = _gaps(lora, outputs)
    assert worst < 1e-4  # adapters start at zero
    pb = policy_batch_from_rollout(RolloutBatch.from_outputs(outputs, pad_token_id=0))
    loss = -(response_log_probs(lora, pb) * pb.response_mask).sum()
    loss.backward()
    grads = [p.grad for n, p in lora.named_parameters() if p.requires_grad and p.grad is not None]
    assert grads
    assert any(float(g.abs().sum()) > 0 for g in grads)
    visual = [p.grad for n, p in lora.named_parameters() if "visual" in n and p.requires_grad]
    assert visual
    assert any(g is not None and float(g.abs().sum()) > 0 for g in visual)  # adapters in the vision tower learn
