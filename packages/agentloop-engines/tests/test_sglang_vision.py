"""SGLangServer with a vision-language checkpoint (the tiny Qwen2-VL): images go to SGLang as
``image_data`` in the prompt's order, at the size the rendering processor resized them to, and
a prompt whose image tokens are not its images' is refused before SGLang sees it.

Against the stand-in (``StandInSGLangEngine``, point (h) of its docstring: it refuses image data
the way SGLang's Qwen-VL processing would mis-serve it), and, gpu-marked, against a real
``sglang.Engine`` (skipped with the reason without SGLang or a CUDA GPU).
"""

from __future__ import annotations

import asyncio
import importlib.util
import os

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
Image = pytest.importorskip("PIL.Image")

from agentloop_core.protocol import CapabilityNotSupportedError  # noqa: E402
from agentloop_core.testing.tiny_vision import tiny_vision_processor  # noqa: E402
from agentloop_core.testing.vision_engines import noise_picture as _picture  # noqa: E402
from agentloop_core.tokenization import ChatRenderer, Trajectory  # noqa: E402
from agentloop_core.vision import load_vision_processor, multi_modal_kwargs  # noqa: E402
from agentloop_engines.adapters.sglang.server import SGLangServer  # noqa: E402
from agentloop_engines.testing import StandInSGLangEngine  # noqa: E402
from agentloop_engines.testing.tiny_vlm import build_tiny_vlm  # noqa: E402

GREEDY = {"max_tokens": 6, "temperature": 0, "ignore_eos": True, "logprobs": True}


@pytest.fixture(scope="module")
def vlm_path():
    return str(build_tiny_vlm(initializer_range=0.3))


@pytest.fixture(scope="module")
def tokenizer(vlm_path):
    return transformers.AutoTokenizer.from_pretrained(vlm_path)


@pytest.fixture(scope="module")
def renderer(tokenizer, vlm_path):
    return ChatRenderer(tokenizer, vision=load_vision_processor(vlm_path, tokenizer))


@pytest.fixture
def engine(vlm_path):
    eng = StandInSGLangEngine(vlm_path)
    yield eng
    eng.loop.close()


@pytest.fixture
async def server(engine, tokenizer):
    srv = SGLangServer(engine, tokenizer=tokenizer)
    yield srv
    await srv.close()



def _with_image(renderer, image, text: str = "What is it?") -> Trajectory:
    return Trajectory(renderer, [{"role": "user", "content": [{"type": "image", "image": image},
                                                              {"type": "text", "text": text}]}])


def _processed_size(item, patch: int = 14) -> tuple[int, int]:
    grid = item.features["image_grid_thw"][0]
    return int(grid[2]) * patch, int(grid[1]) * patch


def test_the_stand_in_refuses_image_data_as_sglang_would_mis_serve_it(engine, renderer):
    """Guards the stand-in itself (point (h)): the adapter tests below prove nothing if it takes
    what SGLang would run wrongly."""
    params = {"max_new_tokens": 3, "temperature": 0, "stop_token_ids": [], "ignore_eos": True}

    def run(ids, image_data, rid):
        return engine.loop.run_until_complete(engine.async_generate(ids, params, True, rid, image_data=image_data))

    big = _picture(300, 200, 0)
    t = _with_image(renderer, big)
    item = t.image_items[0]
    assert item.num_tokens == 54  # grid 12 x 18 from one resize of 300 x 200 within 224 x 224
    # SGLang resizes it to 308 x 196 first (multiples of 28), then within 224 x 224: 12 x 20.
    with pytest.raises(ValueError, match=r"runs of \[54\] but SGLang's processor makes \[60\]"):
        run(t.context_ids, [big], "raw")
    resized = big.resize(_processed_size(item), resample=Image.Resampling.BICUBIC)
    first = run(t.context_ids, [resized], "resized")["output_ids"]
    other = run(t.context_ids, [resized.transpose(Image.Transpose.FLIP_LEFT_RIGHT)], "flipped")["output_ids"]
    assert first != other  # outputs depend on the pixels
    with pytest.raises(TypeError, match="must be a list"):
        run(t.context_ids, (resized,), "tuple")
    with pytest.raises(ValueError, match="runs of"):
        run(t.context_ids, [resized, resized], "two")
    text_only = StandInSGLangEngine()
    try:
        with pytest.raises(ValueError, match="text-only"):
            text_only.loop.run_until_complete(text_only.async_generate([5, 6], params, True, "t", image_data=[resized]))
    finally:
        text_only.shutdown()


async def test_vision_is_declared_for_a_vision_checkpoint_only(server, vlm_path):
    config = transformers.AutoConfig.from_pretrained(vlm_path)
    assert server.capabilities.vision
    assert server.image_token_id == config.image_token_id
    engine = await asyncio.to_thread(StandInSGLangEngine)
    text_server = SGLangServer(engine)
    try:
        assert not text_server.capabilities.vision
        assert text_server.image_token_id is None
        _, processor = tiny_vision_processor()
        item = processor.process(_picture(56, 56, 0))
        with pytest.raises(CapabilityNotSupportedError, match="no vision capability"):
            await text_server.generate("x", [1, 2, 3], GREEDY, multi_modal_data={"image": [item]})
    finally:
        await text_server.close()


async def test_images_reach_sglang_as_image_data_in_order_at_their_processed_size(server, engine, renderer):
    """A prompt image and two tool-result images, of three sizes (one above ``max_pixels``):
    ``image_data`` holds them in order, each at its processed size, so SGLang's token counts
    are the prompt's (the stand-in refuses otherwise); images change the output; the
    trajectory passes the strict sanity check."""
    t = _with_image(renderer, _picture(300, 200, 1), "Zoom in twice.")
    for turn in range(3):
        out = await server.generate(f"mt{turn}", t.context_ids, GREEDY, **multi_modal_kwargs(t.image_items))
        assert engine.calls[-1]["image_sizes"] == [_processed_size(i) for i in t.image_items]
        assert engine.calls[-1]["input_ids"] == t.context_ids  # the expanded ids, as they are
        t.append_generated(out)
        if turn < 2:
            crop = _picture(56 + 40 * turn, 84, turn)
            t.append_messages([{"role": "tool", "content": [{"type": "text", "text": f"crop {turn}:"},
                                                            {"type": "image", "image": crop}]}])
    assert engine.calls[-1]["image_sizes"] == [(252, 168), (56, 84), (84, 84)]  # 96 rounds to 84
    assert t.to_output(sanity_check="strict").multi_modal_data["image"] == t.image_items
    a, b = _with_image(renderer, _picture(112, 112, 7)), _with_image(renderer, _picture(112, 112, 8))
    out_a = await server.generate("a", a.context_ids, GREEDY, **multi_modal_kwargs(a.image_items))
    out_b = await server.generate("b", b.context_ids, GREEDY, **multi_modal_kwargs(b.image_items))
    assert out_a.token_ids != out_b.token_ids


async def test_an_image_at_its_processed_size_is_sent_as_it_is(server, engine, renderer, monkeypatch):
    """No resize where none is needed: an image whose size is already the processed one goes
    to SGLang unchanged (the same object)."""
    image = _picture(112, 56, 3)
    t = _with_image(renderer, image)
    sent = []
    real = engine.async_generate

    async def spy(*args, image_data=None, **kwargs):
        sent.append(image_data)
        return await real(*args, image_data=image_data, **kwargs)

    monkeypatch.setattr(engine, "async_generate", spy)
    await server.generate("same", t.context_ids, GREEDY, **multi_modal_kwargs(t.image_items))
    assert sent[0][0] is t.image_items[0].image


async def test_mismatched_images_are_a_value_error_before_sglang_sees_them(server, engine, renderer):
    t = _with_image(renderer, _picture(56, 56, 1))
    other = _with_image(renderer, _picture(112, 112, 2))
    calls = len(engine.calls)
    with pytest.raises(ValueError, match="image tokens"):
        await server.generate("bad", t.context_ids, GREEDY, **multi_modal_kwargs(other.image_items))
    with pytest.raises(ValueError, match="image tokens"):
        await server.generate("two", t.context_ids, GREEDY, **multi_modal_kwargs(t.image_items * 2))
    with pytest.raises(ValueError, match="only 'image'"):
        await server.generate("video", t.context_ids, GREEDY, multi_modal_data={"video": t.image_items})
    assert len(engine.calls) == calls
    good = await server.generate("good", t.context_ids, GREEDY, **multi_modal_kwargs(t.image_items))
    assert len(good.token_ids) == GREEDY["max_tokens"]


async def test_a_stream_with_images_joins_into_generate(server, renderer):
    t = _with_image(renderer, _picture(80, 70, 4))
    whole = await server.generate("whole", t.context_ids, GREEDY, **multi_modal_kwargs(t.image_items))
    deltas = [d async for d in server.generate_stream("streamed", t.context_ids, GREEDY,
                                                      **multi_modal_kwargs(t.image_items))]
    assert [tok for d in deltas for tok in d.token_ids] == whole.token_ids


def _gpu_and_sglang() -> str | None:
    if importlib.util.find_spec("sglang") is None:
        return 'sglang is not installed (pip install "agentloop-engines[sglang]")'
    if not torch.cuda.is_available():
        return "no CUDA GPU"
    return None


@pytest.mark.gpu
@pytest.mark.skipif(_gpu_and_sglang() is not None, reason=str(_gpu_and_sglang()))
def test_real_sglang_serves_images(vlm_path, tokenizer, renderer):
    """A real sglang.Engine on the tiny Qwen2-VL (float32): greedy tokens and log-probs equal
    HFServer's for a prompt with an image above ``max_pixels`` and for a multi-turn context
    with images in two tool results; mismatched images are refused. A token mismatch on the
    first turn means SGLang ran another prompt than ours (count its image tokens: a grid from
    its own resize); log-probs off by more than the tolerance with the same tokens, other
    pixel values (a resize that is not the identity)."""
    import sglang

    from agentloop_engines.adapters.hf.server import HFServer

    tolerance = 5e-3  # float32 SGLang against HF (test_sglang_real_engine.py's GPU_LOGPROB_TOL)
    engine = sglang.Engine(model_path=vlm_path, mem_fraction_static=float(os.environ.get("SGLANG_MEM", "0.3")),
                           disable_cuda_graph=True, dtype="float32")
    hf = HFServer(vlm_path)

    async def run():
        server = SGLangServer(engine, tokenizer=tokenizer)
        try:
            assert server.capabilities.vision
            t = _with_image(renderer, _picture(300, 200, 1), "Zoom in twice.")
            gaps = []
            for turn in range(3):
                kwargs = multi_modal_kwargs(t.image_items)
                out = await server.generate(f"mt{turn}", t.context_ids, GREEDY, **kwargs)
                ref = await hf.generate(f"ref{turn}", t.context_ids, GREEDY, **kwargs)
                assert out.token_ids == ref.token_ids, (turn, out.token_ids, ref.token_ids)
                gaps += [abs(a - b) for a, b in zip(out.log_probs, ref.log_probs, strict=True)]
                t.append_generated(out)
                if turn < 2:
                    t.append_messages([{"role": "tool", "content": [
                        {"type": "image", "image": _picture(56 + 40 * turn, 84, turn)}]}])
            print(f"SGLang vs HF with images: max |log-prob gap| {max(gaps):.2e}")
            assert max(gaps) < tolerance
            other = _with_image(renderer, _picture(112, 112, 2))
            with pytest.raises(ValueError, match="image tokens"):
                await server.generate("bad", t.context_ids, GREEDY, **multi_modal_kwargs(other.image_items))
        finally:
            await server.close()  # shuts the engine down too

    asyncio.run(run())
