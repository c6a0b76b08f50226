"""The Idefics3 (SmolVLM) vision family end to end on a tiny random model: its processor's
structured expansion (one image, several runs of image tokens), HFServer's prefill with
``pixel_values`` + ``pixel_attention_mask`` and plain positions, log-probs equal to a full
forward, and a multi-turn trajectory that passes the strict sanity check."""

from __future__ import annotations

import asyncio

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
Image = pytest.importorskip("PIL.Image")

from agentloop_core.protocol import TokenOutput  # noqa: E402
from agentloop_core.testing.vision_engines import noise_picture as _picture  # noqa: E402
from agentloop_core.tokenization import ChatRenderer, Trajectory  # noqa: E402
from agentloop_core.vision import (  # noqa: E402
    Idefics3Processor,
    TiledImageItem,
    image_token_runs,
    load_vision_processor,
    multi_modal_kwargs,
    stack_features,
)
from agentloop_engines.adapters.hf.server import HFServer  # noqa: E402
from agentloop_engines.adapters.placeholders import placeholder_token_ids  # noqa: E402
from agentloop_engines.testing.tiny_vlm import build_tiny_vlm  # noqa: E402

INIT = 0.3
NEW_TOKENS = 5


@pytest.fixture(scope="module")
def server():
    return HFServer(build_tiny_vlm(family="idefics3", initializer_range=INIT), max_batch_size=8)


@pytest.fixture(scope="module")
def processor(server):
    return load_vision_processor(build_tiny_vlm(family="idefics3", initializer_range=INIT), server.tokenizer)


@pytest.fixture(scope="module")
def renderer(server, processor):
    return ChatRenderer(server.tokenizer, vision=processor)



def _full_forward_log_probs(model, ids: list[int], items, generated: list[int]) -> list[float]:
    """What a trainer computes: one forward of prompt + generation with the images' tiles, over
    the tokens other than the placeholder ids (banned from sampling in every engine)."""
    x = torch.tensor([ids + generated])
    features = {k: torch.from_numpy(v) for k, v in stack_features(items).items()}
    with torch.no_grad():
        logits = model(input_ids=x, attention_mask=torch.ones_like(x), **features).logits[0].float()
    logits[:, list(placeholder_token_ids(model.config, logits.shape[-1]))] = float("-inf")
    lp = torch.log_softmax(logits, -1)
    n = len(ids)
    return [lp[n - 1 + j, t].item() for j, t in enumerate(generated)]


def _gap(a: list[float] | None, b: list[float] | None) -> float:
    assert a is not None
    assert b is not None
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


def _layout(item) -> tuple[int, int]:
    assert isinstance(item, TiledImageItem)
    return item.rows, item.cols


def _generate(server: HFServer, rows: list[Trajectory], max_tokens: int = NEW_TOKENS):
    async def run():
        return await asyncio.gather(*[
            server.generate(f"i{k}", t.context_ids, {"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True},
                            **multi_modal_kwargs(t.image_items)) for k, t in enumerate(rows)])

    before = dict(server.stats)
    outs = asyncio.run(run())
    return outs, {k: server.stats[k] - before[k] for k in server.stats}


def test_the_tiny_idefics3_is_an_idefics3_checkpoint_whose_image_spans_several_runs(server, processor):
    """``model_type`` idefics3 loads as ``Idefics3ForConditionalGeneration`` with the family's
    processor; a 100x70 image is 2 x 2 tiles plus the global view, 4 tokens each, written
    as transformers' Idefics3Processor writes it. A failure: compare ``processor.expansion``
    with ``Idefics3Processor.replace_image_token`` of transformers."""
    assert transformers.AutoConfig.from_pretrained(server.model_name).model_type == "idefics3"
    assert type(server.model).__name__ == "Idefics3ForConditionalGeneration"
    assert server.capabilities.vision
    assert isinstance(processor, Idefics3Processor)
    assert processor.image_token_id == server.image_token_id
    item = processor.process(_picture(100, 70, 0))
    assert isinstance(item, TiledImageItem)
    assert (item.rows, item.cols, item.num_tokens, item.run_lengths) == (2, 2, 20, (4,) * 5)
    run = "<image>" * 4
    assert processor.expansion(item) == (
        f"<fake_token_around_image><row_1_col_1>{run}<fake_token_around_image><row_1_col_2>{run}\n"
        f"<fake_token_around_image><row_2_col_1>{run}<fake_token_around_image><row_2_col_2>{run}\n"
        f"\n<fake_token_around_image><global-img>{run}<fake_token_around_image>")
    ids = server.tokenizer.encode(processor.expansion(item), add_special_tokens=False)
    assert image_token_runs(ids, [item], processor.image_token_id) == [(2, len(ids) - 1)]


def test_image_rows_prefill_in_one_forward_and_match_the_full_forward(server, renderer):
    """Rows with 0, 1 and 2 images of different tile layouts (2 x 2, 1 x 2) and a text row
    take one prefill forward; each row's log-probs equal its full forward and the one-by-one
    path. A failure: check ``stack_features`` order against the rows' image tokens."""
    rows = [
        Trajectory(renderer, [{"role": "user", "content": [
            {"type": "image", "image": _picture(100, 70, 1)}, {"type": "text", "text": "What is it?"}]}]),
        Trajectory(renderer, [{"role": "user", "content": [
            {"type": "image", "image": _picture(128, 40, 2)}, {"type": "text", "text": "and"},
            {"type": "image", "image": _picture(60, 60, 3)}, {"type": "text", "text": "Compare."}]}]),
        Trajectory(renderer, [{"role": "user", "content": "Only words, no picture at all here."}]),
    ]
    assert [[_layout(i) for i in t.image_items] for t in rows] == [[(2, 2)], [(1, 2), (2, 2)], []]
    batched, stats = _generate(server, rows)
    assert stats["forward_calls"] == NEW_TOKENS  # one prefill forward for all rows
    server.batch_image_prefill = False
    try:
        one_by_one, _ = _generate(server, rows)
    finally:
        server.batch_image_prefill = True
    for t, out, old in zip(rows, batched, one_by_one, strict=True):
        assert _gap(_full_forward_log_probs(server.model, t.context_ids, t.image_items, out.token_ids),
                    out.log_probs) < 1e-4
        assert out.token_ids == old.token_ids
        assert _gap(old.log_probs, out.log_probs) < 1e-4
    assert batched[0].token_ids != batched[1].token_ids


def test_a_multi_turn_trajectory_with_images_passes_the_strict_sanity_check(server, renderer):
    """Images in the first user turn and in a tool result, generated turn by turn on HFServer:
    the delta-built ids equal a full render (strict check) and the last turn's log-probs equal
    a full forward of the whole context."""
    t = Trajectory(renderer, [{"role": "user", "content": [{"type": "image", "image": _picture(90, 60, 5)},
                                                           {"type": "text", "text": "Zoom in."}]}],
                   sanity_check="strict")
    for k in range(2):
        (out,), _ = _generate(server, [t], max_tokens=4)
        t.append_generated(out)
        t.append_messages([{"role": "user", "content": [{"type": "text", "text": "Here:"},
                                                        {"type": "image", "image": _picture(50, 80, 10 + k)}]}])
    (out,), _ = _generate(server, [t], max_tokens=4)
    assert _gap(_full_forward_log_probs(server.model, t.context_ids, t.image_items, out.token_ids),
                out.log_probs) < 1e-4
    t.append_generated(out)
    data = t.to_output(sanity_check="strict").multi_modal_data
    assert data is not None
    assert data["image"] == t.image_items
    assert len(t.image_items) == 3


def test_an_image_sent_for_another_layouts_tokens_fails_that_request_alone(server, renderer):
    """A 2 x 2 image's tokens (5 runs) sent with a 1 x 2 image (3 runs): refused with the runs
    found and expected; the other request of the batch is served."""
    wide = Trajectory(renderer, [{"role": "user", "content": [{"type": "image", "image": _picture(128, 40, 2)}]}])
    square = Trajectory(renderer, [{"role": "user", "content": [{"type": "image", "image": _picture(100, 70, 1)}]}])

    async def run():
        return await asyncio.gather(
            server.generate("bad", square.context_ids, {"max_tokens": 2}, **multi_modal_kwargs(wide.image_items)),
            server.generate("good", square.context_ids, {"max_tokens": 2}, **multi_modal_kwargs(square.image_items)),
            return_exceptions=True)

    bad, good = asyncio.run(run())
    assert isinstance(bad, ValueError)
    assert "in 5 run(s) of [4, 4, 4, 4, 4] but its 1 image(s) fill [4, 4, 4]" in str(bad)
    assert isinstance(good, TokenOutput)
