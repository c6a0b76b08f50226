"""One log-prob convention under the placeholder ban (issue #43): a vision-language model's
image/video placeholder ids are banned from sampling in every engine, and HFServer's log-probs,
vLLM's, SGLang's and the trainer's recomputation (policy, old and reference) are all of the
banned distribution, ``log_softmax`` with the placeholder columns at -inf.

On the random tiny Qwen2-VL the placeholders hold enough mass that the full-vocabulary log-probs
differ by more than 1e-3, so each agreement check below can fail. Image tokens in the prompt and
in tool results are targets too (mask 0): they must score a finite 0, not -inf, or the loss and
its gradients turn NaN."""

from __future__ import annotations

import asyncio
import copy
import math

import pytest

torch = pytest.importorskip("torch")
Image = pytest.importorskip("PIL.Image")

from agentloop_core.batch import RolloutBatch  # noqa: E402
from agentloop_core.tokenization import ChatRenderer, Trajectory  # noqa: E402
from agentloop_core.vision import load_vision_processor, multi_modal_kwargs  # noqa: E402
from agentloop_engines.adapters.hf.server import HFServer  # noqa: E402
from agentloop_engines.testing.tiny_vlm import build_tiny_vlm  # noqa: E402
from agentloop_trainer.update import (  # noqa: E402
    ActorConfig,
    PolicyGradientActor,
    policy_batch_from_rollout,
    response_log_probs,
)
from agentloop_trainer.update import forward as forward_module  # noqa: E402
from agentloop_trainer.update import vision_forward as vision_module  # noqa: E402
from agentloop_trainer.update.placeholder_mask import banned_token_ids, token_log_probs  # noqa: E402

TOOLS = [{"type": "function", "function": {"name": "zoom", "description": "Crop the image.",
                                           "parameters": {"type": "object", "properties": {}}}}]
ATOL = 1e-4
"""HFServer against the trainer's forward, float32 (as in test_vision_logprobs.py)."""
CONVENTION_GAP = 1e-3
"""The least the full-vocabulary log-probs must differ somewhere for the checks to mean anything."""


def _picture(w: int, h: int, seed: int):
    import numpy as np

    return Image.fromarray((np.random.RandomState(seed).rand(h, w, 3) * 255).astype("uint8"))


@pytest.fixture(scope="module")
def rollout():
    """HFServer on the random tiny Qwen2-VL, sampling at temperature 1: one trajectory with an
    image in the prompt and one in each of two tool results; a text-only one; and two samples
    of one text-only prompt (a GRPO group, for the shared-prompt forward)."""
    path = build_tiny_vlm(initializer_range=0.3)
    server = HFServer(path)
    renderer = ChatRenderer(server.tokenizer, tools=TOOLS, vision=load_vision_processor(path, server.tokenizer))
    with_images = Trajectory(renderer, [{"role": "user", "content": [
        {"type": "image", "image": _picture(150, 100, 1)}, {"type": "text", "text": "What is in the corner?"}]}],
        sanity_check="strict")
    text_only = Trajectory(renderer, [{"role": "user", "content": "Count to three."}], sanity_check="strict")
    group = [Trajectory(renderer, [{"role": "system", "content": "You are terse and you count carefully."},
                                   {"role": "user", "content": "Count to three, then stop."}], sanity_check="strict")
             for _ in range(2)]

    async def turn(t: Trajectory, seed: int) -> None:
        out = await server.generate(f"r{id(t)}", t.context_ids, {"max_tokens": 8, "seed": seed, "temperature": 1.0},
                                    **multi_modal_kwargs(t.image_items))
        t.append_generated(out)

    async def run() -> None:
        for k in range(3):
            await asyncio.gather(turn(with_images, k), turn(text_only, 10 + k))
            if k < 2:
                with_images.append_messages([{"role": "tool", "name": "zoom", "content": [
                    {"type": "text", "text": "Zoomed:"}, {"type": "image", "image": _picture(60 + 30 * k, 60, 2 + k)}]}])
                text_only.append_messages([{"role": "user", "content": "Go on."}])
        await asyncio.gather(*(turn(t, 20 + k) for k, t in enumerate(group)))

    asyncio.run(run())
    model = server.model
    asyncio.run(server.close())
    outputs = [t.to_output(sanity_check="strict") for t in (with_images, text_only, *group)]
    return model, outputs


def _gap(model, outputs, **kwargs) -> float:
    pb = policy_batch_from_rollout(RolloutBatch.from_outputs(outputs, pad_token_id=0))
    with torch.no_grad():
        logp = response_log_probs(model, pb, **kwargs)
    assert bool(torch.isfinite(logp).all())
    return float((logp - pb.rollout_log_probs).abs()[pb.response_mask.bool()].max())


def _full_vocabulary(monkeypatch) -> None:
    """The old convention: the trainer's forwards ban nothing."""
    monkeypatch.setattr(vision_module, "banned_token_ids", lambda model: ())
    monkeypatch.setattr(forward_module, "banned_token_ids", lambda model: ())


def test_the_policy_bans_both_placeholders_and_the_rollout_holds_images_with_mask_0(rollout):
    model, outputs = rollout
    assert banned_token_ids(model) == (model.config.image_token_id, model.config.video_token_id)
    assert len(outputs[0].multi_modal_data["image"]) == 3
    pad = model.config.image_token_id
    assert pad in outputs[0].prompt_ids
    in_tools = [m for t, m in zip(outputs[0].response_ids, outputs[0].response_mask, strict=True) if t == pad]
    assert in_tools
    assert not any(in_tools)


def test_trainer_recomputes_hfservers_sampled_log_probs_with_images(rollout, monkeypatch):
    """The batch with images (images in the prompt and two tool results, batched with a text-only
    row) through the multimodal forward: HFServer's T=1 log-probs within 1e-4; the
    full-vocabulary ones differ by more than 1e-3."""
    model, outputs = rollout
    worst = _gap(model, outputs[:2])
    _full_vocabulary(monkeypatch)
    full = _gap(model, outputs[:2])
    print(f"with images: max |HF - trainer| {worst:.2e}, max |HF - full vocabulary| {full:.2e}")
    assert worst < ATOL
    assert full > CONVENTION_GAP


@pytest.mark.parametrize("share_prompts", [False, True], ids=["sequence_log_probs", "prompt_shared_log_probs"])
def test_trainer_recomputes_a_vision_models_text_only_rows_alike(rollout, monkeypatch, share_prompts):
    """Rows without images of a vision-language policy take the text forwards (shared prefix, or
    each distinct prompt once); HFServer banned the placeholders there too."""
    model, outputs = rollout
    worst = _gap(model, outputs[1:], share_prompts=share_prompts)
    _full_vocabulary(monkeypatch)
    full = _gap(model, outputs[1:], share_prompts=share_prompts)
    print(f"text rows ({'shared prompts' if share_prompts else 'shared prefix'}): max |HF - trainer| {worst:.2e}, "
          f"max |HF - full vocabulary| {full:.2e}")
    assert worst < ATOL
    assert full > CONVENTION_GAP


def test_an_update_with_kl_on_a_batch_with_image_tokens_is_finite(rollout, monkeypatch):
    """Old, reference and new log-probs under the ban (the reference's differs from the
    full-vocabulary one); the image tokens in the prompt and the tool results (targets with mask
    0) leave the loss and every gradient finite, and the rollout-vs-trainer gap the update
    reports is numerics only."""
    model, outputs = rollout
    policy = copy.deepcopy(model).train()
    actor = PolicyGradientActor(policy, ActorConfig(lr=1e-3, tis_cap=None, use_kl_loss=True, kl_loss_coef=0.5),
                                ref_model=copy.deepcopy(model).eval())
    pb = policy_batch_from_rollout(RolloutBatch.from_outputs(outputs[:2], pad_token_id=0))
    old = actor.compute_log_probs(pb)
    ref = actor.reference_log_probs(pb)
    assert bool(torch.isfinite(old).all())
    assert bool(torch.isfinite(ref).all())
    grads: list = []
    hooks = [p.register_hook(lambda g: grads.append(g.detach().clone()) or g)
             for p in policy.parameters() if p.requires_grad]
    metrics = actor.update(pb, torch.tensor([1.0, -1.0]), old_log_probs=old, ref_log_probs=ref)
    for h in hooks:
        h.remove()
    _full_vocabulary(monkeypatch)
    full = actor.reference_log_probs(pb)
    assert float((ref - full).abs()[pb.response_mask.bool()].max()) > CONVENTION_GAP
    assert all(math.isfinite(v) for v in metrics.values()), metrics
    assert metrics["actor/grad_norm"] > 0
    assert grads
    assert all(bool(torch.isfinite(g).all()) for g in grads)
    assert all(bool(torch.isfinite(p).all()) for p in policy.parameters())
    assert metrics["rollout/logprob_abs_diff_max"] < ATOL


def test_token_log_probs_scores_banned_targets_0_with_finite_gradients():
    """The helper itself: the banned distribution's log-probs, a banned target scoring 0 with a
    finite gradient (gathering -inf and masking it afterwards would give NaN), and nothing
    banned: the full vocabulary's."""
    logits = torch.randn(2, 3, 10, generator=torch.Generator().manual_seed(0), requires_grad=True)
    targets = torch.tensor([[1, 7, 2], [8, 3, 4]])
    banned = (7, 8, 42)  # 42 is past the vocabulary: ignored
    lp = token_log_probs(logits, targets, banned)
    allowed = logits.detach().clone()
    allowed[..., [7, 8]] = float("-inf")
    expected = torch.log_softmax(allowed, -1).gather(-1, targets[..., None])[..., 0]
    is_banned = torch.isin(targets, torch.tensor([7, 8]))
    torch.testing.assert_close(lp.detach()[~is_banned], expected[~is_banned])
    assert lp.detach()[is_banned].tolist() == [0.0, 0.0]
    (lp * (~is_banned).float()).sum().backward()
    assert logits.grad is not None
    assert bool(torch.isfinite(logits.grad).all())
    assert float(logits.grad[..., [7, 8]].abs().sum()) == 0.0
    plain = token_log_probs(logits.detach(), targets)
    torch.testing.assert_close(plain, torch.log_softmax(logits.detach(), -1).gather(-1, targets[..., None])[..., 0])
