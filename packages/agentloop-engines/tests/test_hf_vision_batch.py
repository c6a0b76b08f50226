"""HFServer prefills the prompts with images that arrive together in one left-padded forward:
per-row M-RoPE positions, the images' features concatenated in row order, each row's own next
position. Its log-probs equal a full forward of each row and the one-by-one path."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
Image = pytest.importorskip("PIL.Image")

from vision_checks import full_forward_log_probs as _full_forward_log_probs  # noqa: E402
from vision_checks import gap as _gap  # noqa: E402

from agentloop_core.protocol import TokenOutput  # noqa: E402
from agentloop_core.testing.vision_engines import noise_picture as _picture  # noqa: E402
from agentloop_core.tokenization import ChatRenderer, Trajectory  # noqa: E402
from agentloop_core.vision import load_vision_processor, multi_modal_kwargs  # noqa: E402
from agentloop_engines.adapters.hf.server import HFServer  # noqa: E402
from agentloop_engines.adapters.hf.vision import linear_patch_embeddings  # noqa: E402
from agentloop_engines.testing.tiny_vlm import build_tiny_vlm  # noqa: E402

INIT = 0.3
NEW_TOKENS = 5



def _mixed_rows(renderer) -> list[Trajectory]:
    """Rows of different lengths: two images, one image (two sizes), none; one image row has a
    later turn, so its image sits mid-prompt."""
    two = Trajectory(renderer, [{"role": "user", "content": [
        {"type": "image", "image": _picture(56, 84, 1)}, {"type": "text", "text": "and"},
        {"type": "image", "image": _picture(112, 56, 2)}, {"type": "text", "text": "Compare them."}]}])
    one = Trajectory(renderer, [{"role": "user", "content": [
        {"type": "image", "image": _picture(100, 70, 3)}, {"type": "text", "text": "What is it?"}]}])
    later = Trajectory(renderer, [{"role": "user", "content": "A long question about nothing in particular first."}])
    late_image = Trajectory(renderer, [{"role": "user", "content": "Look."},
                                       {"role": "assistant", "content": "Where?"},
                                       {"role": "user", "content": [{"type": "image", "image": _picture(60, 90, 4)}]}])
    text = Trajectory(renderer, [{"role": "user", "content": "No picture here, only words."}])
    return [two, one, late_image, text, later]


def _generate(server: HFServer, rows: list[Trajectory]):
    async def run():
        return await asyncio.gather(*[
            server.generate(f"r{k}", t.context_ids, {"max_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True},
                            **multi_modal_kwargs(t.image_items)) for k, t in enumerate(rows)])

    before = dict(server.stats)
    outs = asyncio.run(run())
    return outs, {k: server.stats[k] - before[k] for k in server.stats}


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
def test_image_rows_and_text_rows_prefill_in_one_forward_with_full_forward_log_probs(family):
    """Mixed rows (0, 1 and 2 images, images mid-prompt, different lengths) take ONE prefill
    forward, then NEW_TOKENS - 1 decode steps; every row's log-probs equal its full forward
    and the one-by-one path's. A failure: print ``server.stats`` (forward_calls counts the
    prefill) and compare the positions of ``prefill_inputs`` with ``get_rope_index`` per row."""
    path = build_tiny_vlm(family=family, initializer_range=INIT)
    server = HFServer(path, max_batch_size=8)
    processor = load_vision_processor(path, server.tokenizer)
    rows = _mixed_rows(ChatRenderer(server.tokenizer, vision=processor))
    assert len({len(t.context_ids) for t in rows}) == len(rows)

    batched, stats = _generate(server, rows)
    assert stats["forward_calls"] == NEW_TOKENS  # one prefill forward for all five rows
    server.batch_image_prefill = False
    one_by_one, old_stats = _generate(server, rows)
    assert old_stats["forward_calls"] == NEW_TOKENS + 3  # three image rows alone, text rows together

    # The reference is the checkpoint as transformers loads it (no engine patches).
    reference = transformers.AutoModelForImageTextToText.from_pretrained(path).eval()
    for t, out, old in zip(rows, batched, one_by_one, strict=True):
        ref = _full_forward_log_probs(reference, processor, t.context_ids, t.image_items, out.token_ids)
        assert _gap(ref, out.log_probs) < 1e-4, family
        assert out.token_ids == old.token_ids
        assert _gap(old.log_probs, out.log_probs) < 1e-4, family
    assert len({tuple(o.token_ids) for o in batched[:3]}) > 1  # the images matter


def test_samples_of_one_prompt_with_its_image_are_prefilled_once():
    """A GRPO group: four samples of one prompt and image compute it once (counted in
    ``repeated_prompt_tokens``) and each gets the same first-token distribution."""
    path = build_tiny_vlm(initializer_range=INIT)
    server = HFServer(path, max_batch_size=8)
    processor = load_vision_processor(path, server.tokenizer)
    r = ChatRenderer(server.tokenizer, vision=processor)
    t = Trajectory(r, [{"role": "user", "content": [{"type": "image", "image": _picture(84, 84, 9)},
                                                    {"type": "text", "text": "Describe."}]}])
    other = Trajectory(r, [{"role": "user", "content": [{"type": "image", "image": _picture(84, 84, 10)},
                                                        {"type": "text", "text": "Describe."}]}])
    outs, stats = _generate(server, [t, t, t, t, other])
    assert stats["repeated_prompt_tokens"] == 3 * len(t.context_ids)  # same ids, other pixels: not repeated
    assert stats["prefill_tokens"] == 2 * len(t.context_ids)
    assert len({tuple(o.token_ids) for o in outs[:4]}) == 1
    for traj, out in ((t, outs[0]), (other, outs[4])):
        ref = _full_forward_log_probs(server.model, processor, traj.context_ids, traj.image_items, out.token_ids)
        assert _gap(ref, out.log_probs) < 1e-4


def test_a_batch_whose_forward_fails_falls_back_to_rows_so_only_the_broken_row_fails():
    """An image whose features the vision tower cannot read (token count right, patches cut
    short of its grid) breaks the batched forward; the rows are then prefilled one by one and only that
    row fails, with the model's error."""
    path = build_tiny_vlm(initializer_range=INIT)
    server = HFServer(path, max_batch_size=8)
    processor = load_vision_processor(path, server.tokenizer)
    r = ChatRenderer(server.tokenizer, vision=processor)
    good = Trajectory(r, [{"role": "user", "content": [{"type": "image", "image": _picture(56, 56, 1)}]}])
    item = good.image_items[0]
    broken = dataclasses.replace(item, digest="sha256:" + "0" * 32, features={**item.features,
                                                 "pixel_values": item.features["pixel_values"][:-4]})
    text = Trajectory(r, [{"role": "user", "content": "Just words."}])

    async def run():
        params = {"max_tokens": 3, "temperature": 0}
        return await asyncio.gather(
            server.generate("good", good.context_ids, params, **multi_modal_kwargs(good.image_items)),
            server.generate("broken", good.context_ids, params, multi_modal_data={"image": [broken]}),
            server.generate("text", text.context_ids, params), return_exceptions=True)

    before = server.stats["image_prefill_fallbacks"]
    ok, failed, plain = asyncio.run(run())
    assert server.stats["image_prefill_fallbacks"] == before + 1  # counted and logged, not silent
    assert isinstance(failed, Exception), failed
    assert isinstance(ok, TokenOutput)
    assert isinstance(plain, TokenOutput)
    ref = _full_forward_log_probs(server.model, processor, good.context_ids, good.image_items, ok.token_ids)
    assert _gap(ref, ok.log_probs) < 1e-4
    assert len(plain.token_ids) >= 1


def test_a_patch_convolution_runs_as_a_matmul_with_the_same_result():
    """Qwen-VL's patch embedding (a Conv3d whose kernel is its stride, fed kernel-sized
    blocks) runs as a matrix product, equal to the convolution; other inputs, and other
    convolutions, are left to the convolution."""
    torch.manual_seed(0)
    patch = torch.nn.Conv3d(3, 8, kernel_size=(2, 4, 4), stride=(2, 4, 4), bias=True)
    overlapping = torch.nn.Conv3d(3, 8, kernel_size=(2, 4, 4), stride=(1, 2, 2))
    model = torch.nn.ModuleList([patch, overlapping])
    blocks, volume = torch.randn(10, 3, 2, 4, 4), torch.randn(2, 3, 4, 8, 8)
    with torch.no_grad():
        expected = [patch(blocks), patch(volume), overlapping(volume)]
        assert linear_patch_embeddings(model) == 1
        got = [patch(blocks), patch(volume), overlapping(volume)]
    for e, g in zip(expected, got, strict=True):
        assert e.shape == g.shape
        assert torch.allclose(e, g, atol=1e-5)
    assert "forward" in vars(patch)
    assert "forward" not in vars(overlapping)
