"""HFServer with a vision-language model: prefill with pixel values and M-RoPE positions, decode
batched with text rows, log-probs equal to a full forward of the model; and what it refuses."""

from __future__ import annotations

import asyncio

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
Image = pytest.importorskip("PIL.Image")

from vision_checks import full_forward_log_probs as _full_forward_log_probs  # noqa: E402

from agentloop_core.protocol import CapabilityNotSupportedError  # noqa: E402
from agentloop_core.testing.vision_engines import noise_picture as _picture  # noqa: E402
from agentloop_core.tokenization import ChatRenderer, Trajectory  # noqa: E402
from agentloop_core.vision import load_vision_processor, multi_modal_kwargs  # noqa: E402
from agentloop_engines.adapters.hf.server import HFServer  # noqa: E402
from agentloop_engines.testing.tiny_vlm import build_tiny_vlm  # noqa: E402

INIT = 0.3


@pytest.fixture(scope="module")
def vlm_path():
    return build_tiny_vlm(initializer_range=INIT)


@pytest.fixture(scope="module")
def server(vlm_path):
    return HFServer(vlm_path, max_batch_size=8)


@pytest.fixture(scope="module")
def renderer(server, vlm_path):
    return ChatRenderer(server.tokenizer, vision=load_vision_processor(vlm_path, server.tokenizer))



def test_the_tiny_vlm_is_a_qwen2_vl_checkpoint_with_its_processor(vlm_path, server):
    config = transformers.AutoConfig.from_pretrained(vlm_path)
    assert config.model_type == "qwen2_vl"
    assert type(server.model).__name__ == "Qwen2VLForConditionalGeneration"
    assert server.capabilities.vision
    processor = load_vision_processor(vlm_path, server.tokenizer)
    assert processor.image_token_id == config.image_token_id
    # A 112x112 image: grid [1, 8, 8], merged 2x2: 16 tokens.
    assert processor.process(_picture(112, 112, 0)).num_tokens == 16


def test_images_rows_and_text_rows_decode_together_with_full_forward_log_probs(server, renderer):
    trajectories = [Trajectory(renderer, [{"role": "user", "content": [
        {"type": "image", "image": _picture(80 + 30 * k, 70, k)}, {"type": "text", "text": "What is it?"}]}])
        for k in range(3)]
    trajectories.append(Trajectory(renderer, [{"role": "user", "content": "No image here."}]))

    async def run():
        return await asyncio.gather(*[
            server.generate(f"v{k}", t.context_ids, {"max_tokens": 10, "temperature": 0},
                            **multi_modal_kwargs(t.image_items))
            for k, t in enumerate(trajectories)])

    before = dict(server.stats)
    outs = asyncio.run(run())
    assert server.stats["max_batch_rows"] >= 2  # image rows decoded in one batch with the text row
    assert server.stats["prefill_tokens"] - before["prefill_tokens"] == sum(len(t.context_ids) for t in trajectories)
    gaps = []
    for t, out in zip(trajectories, outs, strict=True):
        assert len(out.token_ids) >= 1
        ref = _full_forward_log_probs(server.model, renderer.vision, t.context_ids, t.image_items, out.token_ids)
        gaps += [abs(a - b) for a, b in zip(ref, out.log_probs, strict=True)]
    assert max(gaps) < 1e-4, max(gaps)
    # Images change what the model generates: the same text with another image differs.
    assert len({tuple(o.token_ids) for o in outs[:3]}) > 1


def test_a_multi_turn_context_with_images_in_prompt_and_tool_results(server, renderer):
    t = Trajectory(renderer, [{"role": "user", "content": [{"type": "image", "image": _picture(100, 60, 5)},
                                                           {"type": "text", "text": "Zoom in."}]}])

    async def turn():
        return await server.generate("mt", t.context_ids, {"max_tokens": 6, "temperature": 0},
                                    **multi_modal_kwargs(t.image_items))

    for k in range(2):
        out = asyncio.run(turn())
        t.append_generated(out)
        t.append_messages([{"role": "user", "content": [{"type": "text", "text": "Here:"},
                                                        {"type": "image", "image": _picture(56, 84, 10 + k)}]}])
    out = asyncio.run(turn())
    ref = _full_forward_log_probs(server.model, renderer.vision, t.context_ids, t.image_items, out.token_ids)
    assert max(abs(a - b) for a, b in zip(ref, out.log_probs, strict=True)) < 1e-4
    t.append_generated(out)
    assert t.to_output(sanity_check="strict").multi_modal_data["image"] == t.image_items
    assert len(t.image_items) == 3


def test_a_prompt_whose_image_tokens_do_not_match_its_images_fails_that_request_alone(server, renderer):
    t = Trajectory(renderer, [{"role": "user", "content": [{"type": "image", "image": _picture(56, 56, 1)}]}])
    other = Trajectory(renderer, [{"role": "user", "content": [{"type": "image", "image": _picture(112, 112, 2)}]}])

    async def run():
        return await asyncio.gather(
            server.generate("bad", t.context_ids, {"max_tokens": 4}, **multi_modal_kwargs(other.image_items)),
            server.generate("good", t.context_ids, {"max_tokens": 4}, **multi_modal_kwargs(t.image_items)),
            return_exceptions=True)

    bad, good = asyncio.run(run())
    assert isinstance(bad, ValueError)
    assert "image tokens" in str(bad)
    assert len(good.token_ids) >= 1


def test_a_text_model_refuses_images_and_names_the_capability(model_path):
    from agentloop_core.testing.tiny_vision import tiny_vision_processor

    _, processor = tiny_vision_processor()
    item = processor.process(_picture(56, 56, 0))
    text_server = HFServer(model_path)
    assert not text_server.capabilities.vision
    with pytest.raises(CapabilityNotSupportedError, match="no vision capability"):
        asyncio.run(text_server.generate("x", [1, 2, 3], {"max_tokens": 2}, multi_modal_data={"image": [item]}))
    with pytest.raises(ValueError, match="takes only 'image'"):
        asyncio.run(text_server.generate("x", [1, 2, 3], {"max_tokens": 2}, multi_modal_data={"video": [item]}))


def test_a_text_model_folder_has_no_vision_processor_and_an_unknown_vision_type_is_an_error(model_path, tmp_path):
    import json

    assert load_vision_processor(model_path, None) is None
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "new_vlm", "vision_config": {}}))
    with pytest.raises(ValueError, match="no vision family handles it; known: .*qwen2_vl"):
        load_vision_processor(tmp_path, None)


def test_the_routing_client_generates_and_streams_with_images(server, renderer):
    from agentloop_engines.fleet.client import LLMServerClient

    t = Trajectory(renderer, [{"role": "user", "content": [{"type": "image", "image": _picture(84, 56, 7)},
                                                           {"type": "text", "text": "Describe."}]}])
    client = LLMServerClient([server])
    params = {"max_tokens": 6, "temperature": 0}

    async def run():
        whole = await client.generate("c1", t.context_ids, params, **multi_modal_kwargs(t.image_items))
        ids = []
        async for delta in client.generate_stream("c2", t.context_ids, params, **multi_modal_kwargs(t.image_items)):
            ids += delta.token_ids
        direct = await server.generate("c3", t.context_ids, params, **multi_modal_kwargs(t.image_items))
        return whole, ids, direct

    whole, streamed, direct = asyncio.run(run())
    assert whole.token_ids == streamed == direct.token_ids


def test_images_sent_in_another_order_than_their_tokens_are_refused(server, renderer):
    """Two images of different sizes, sent swapped: the total of image tokens matches, each
    run does not; the request fails alone instead of filling one image's tokens with the other."""
    t = Trajectory(renderer, [{"role": "user", "content": [{"type": "image", "image": _picture(56, 56, 1)},
                                                           {"type": "image", "image": _picture(112, 56, 2)}]}])
    first, second = t.image_items
    assert first.num_tokens != second.num_tokens
    with pytest.raises(ValueError, match=r"in 2 run\(s\) of \[4, 8\] but its 2 image\(s\) fill \[8, 4\]"):
        asyncio.run(server.generate("swap", t.context_ids, {"max_tokens": 2},
                                    multi_modal_data={"image": [second, first]}))


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
def test_each_qwen_vl_generation_decodes_with_images_as_its_full_forward(family):
    """Qwen2-VL, Qwen2.5-VL (windowed vision attention) and Qwen3-VL (16 px patches, interleaved
    M-RoPE, deepstack): a multi-turn context with an image in the prompt and in a later user
    turn, batched with a text row; the engine's log-probs equal the model's full forward."""
    from agentloop_engines.testing.tiny_vlm import build_tiny_vlm as build

    path = build(family=family, initializer_range=INIT)
    engine = HFServer(path)
    processor = load_vision_processor(path, engine.tokenizer)
    assert engine.capabilities.vision
    assert processor is not None
    r = ChatRenderer(engine.tokenizer, vision=processor)
    t = Trajectory(r, [{"role": "user", "content": [{"type": "image", "image": _picture(100, 70, 3)},
                                                    {"type": "text", "text": "What?"}]}])
    text = Trajectory(r, [{"role": "user", "content": "No picture."}])

    async def turn(traj, rid):
        return await engine.generate(rid, traj.context_ids, {"max_tokens": 6, "temperature": 0},
                                     **multi_modal_kwargs(traj.image_items))

    async def both():
        return await asyncio.gather(turn(t, "img"), turn(text, "txt"))

    first, _ = asyncio.run(both())
    t.append_generated(first)
    t.append_messages([{"role": "user", "content": [{"type": "image", "image": _picture(60, 90, 4)}]}])
    out, plain = asyncio.run(both())
    for traj, result in ((t, out), (text, plain)):
        ref = _full_forward_log_probs(engine.model, processor, traj.context_ids, traj.image_items, result.token_ids)
        assert max(abs(a - b) for a, b in zip(ref, result.log_probs, strict=True)) < 1e-4, family
