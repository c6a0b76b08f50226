"""Rows with images that the update must score without crashing the step, on the tiny
vision-language model: a failed sample whose output kept its image prompt's ids (with or without
its images), and rows the batch cut to fit (``RolloutBatch.from_outputs(truncate=True)``, as the
trainer builds its batches) inside a tool image or the prompt's image. The healthy rows beside them
still score exactly the engine's log-probs."""

from __future__ import annotations

import asyncio

import pytest

torch = pytest.importorskip("torch")
Image = pytest.importorskip("PIL.Image")

from agentloop_core.batch import RolloutBatch  # noqa: E402
from agentloop_core.output import AgentLoopOutput  # noqa: E402
from agentloop_core.tokenization import ChatRenderer, Trajectory  # noqa: E402
from agentloop_core.vision import load_vision_processor, multi_modal_kwargs  # noqa: E402
from agentloop_engines.adapters.hf.server import HFServer  # noqa: E402
from agentloop_engines.testing.tiny_vlm import build_tiny_vlm  # noqa: E402
from agentloop_trainer.update import policy_batch_from_rollout, response_log_probs  # noqa: E402


def _picture(w: int, h: int, seed: int):
    import numpy as np

    return Image.fromarray((np.random.RandomState(seed).rand(h, w, 3) * 255).astype("uint8"))


@pytest.fixture(scope="module")
def rollout():
    """The served model, the image token id, and three outputs sampled by HFServer: an image in
    the prompt and one in each of two tool results; text only; an image and a long question."""
    path = build_tiny_vlm(initializer_range=0.3)
    server = HFServer(path)
    renderer = ChatRenderer(server.tokenizer, vision=load_vision_processor(path, server.tokenizer))
    assert renderer.vision is not None
    tools = Trajectory(renderer, [{"role": "user", "content": [
        {"type": "image", "image": _picture(56, 56, 1)}, {"type": "text", "text": "What is in the corner?"}]}],
        sanity_check="strict")
    text = Trajectory(renderer, [{"role": "user", "content": "Count to three."}], sanity_check="strict")
    long = Trajectory(renderer, [{"role": "user", "content": [
        {"type": "image", "image": _picture(112, 112, 4)}, {"type": "text", "text": "describe " * 20}]}],
        sanity_check="strict")

    async def turn(t: Trajectory, k: int) -> None:
        out = await server.generate(f"r{id(t)}-{k}", t.context_ids, {"max_tokens": 6, "seed": k, "logprobs": True},
                                    **multi_modal_kwargs(t.image_items))
        t.append_generated(out)

    async def run() -> None:
        await asyncio.gather(turn(text, 10), turn(long, 20))
        for k in range(3):
            await turn(tools, k)
            if k < 2:
                tools.append_messages([{"role": "tool", "name": "zoom", "content": [
                    {"type": "text", "text": "Zoomed:"}, {"type": "image", "image": _picture(112, 56 + 28 * k, 2 + k)}]}])

    asyncio.run(run())
    outputs = [t.to_output(sanity_check="strict") for t in (tools, text, long)]
    return server.model, renderer.vision.image_token_id, outputs


def _score(model, batch: RolloutBatch, mask_truncated: bool = False):
    pb = policy_batch_from_rollout(batch, mask_truncated=mask_truncated)
    with torch.no_grad():
        logp = response_log_probs(model, pb)
    return pb, logp


def _worst_gap(pb, logp) -> float:
    mask = pb.response_mask.bool()
    assert mask.any()
    return float((logp - pb.rollout_log_probs).abs()[mask].max())


@pytest.mark.parametrize("keeps_images", [False, True], ids=["without-its-images", "with-its-images"])
def test_a_failed_sample_that_kept_its_image_prompt_does_not_crash_the_step(rollout, keeps_images):
    """react_agent's history-rewrite failure keeps the prompt's ids: image tokens, which no
    image of the row fills unless the loop kept them. It trains nothing, so it runs as a stand-in."""
    model, image_id, (tools, text, long) = rollout
    failed = AgentLoopOutput.failure(long.prompt_ids, "HistoryRewrittenError: message 1 differs", history_rewritten=1)
    if keeps_images:
        failed.multi_modal_data = long.multi_modal_data
    assert failed.prompt_ids.count(image_id) > 0
    batch = RolloutBatch.from_outputs([tools, failed, text], pad_token_id=0)
    assert batch.metrics["rollout/num_failed"] == 1
    assert batch.metrics["rollout/num_samples"] == 3
    pb, logp = _score(model, batch)
    assert not pb.response_mask[1].any()
    assert not logp[1].any()
    assert _worst_gap(pb, logp) < 1e-4  # the healthy rows beside it are scored exactly
    # A micro-batch of the failed row alone, or of failed rows only, runs too.
    with torch.no_grad():
        assert not response_log_probs(model, pb, rows=[1]).any()
        only_failed = RolloutBatch.from_outputs([failed, failed], pad_token_id=0)
        assert not response_log_probs(model, policy_batch_from_rollout(only_failed)).any()


def test_a_response_cut_inside_a_tool_image_drops_it_and_trains_exactly_on_the_rest(rollout):
    model, image_id, (tools, text, _) = rollout
    R = tools.response_ids.index(image_id) + 3  # 3 tokens into the first tool image
    batch = RolloutBatch.from_outputs([tools, text], response_length=R, pad_token_id=0, truncate=True)
    assert batch.truncated.tolist() == [True, False]
    assert batch.metrics["rollout/num_images_cut"] == 2
    assert len((batch.multi_modal_data[0] or {})["image"]) == 1  # the prompt's image
    pb, logp = _score(model, batch)
    assert pb.response_mask[0].any()  # generated tokens before the cut still train...
    assert _worst_gap(pb, logp) < 1e-4  # ...on exactly the engine's log-probs
    pb, logp = _score(model, batch, mask_truncated=True)
    assert not pb.response_mask[0].any()
    assert not logp[0].any()
    assert _worst_gap(pb, logp) < 1e-4


def test_a_prompt_cut_inside_its_image_drops_the_image_and_scores(rollout):
    model, image_id, (_, text, long) = rollout
    P = len(long.prompt_ids) - long.prompt_ids.index(image_id) - 3  # 3 tokens into the image's run
    batch = RolloutBatch.from_outputs([long, text], prompt_length=P, pad_token_id=0, truncate=True)
    assert batch.truncated.tolist() == [True, False]
    assert batch.multi_modal_data[0] is None
    assert batch.metrics["rollout/num_images_cut"] == 1
    assert image_id not in batch.prompts[0].tolist()
    for mask_truncated in (False, True):
        pb, logp = _score(model, batch, mask_truncated=mask_truncated)
        assert torch.isfinite(logp).all()
