"""vLLM and SGLang refuse a tiled image (Idefics3/SmolVLM: several runs of image tokens, the
tiles' text between them), whose expansion their one-placeholder-per-image token prompts cannot
carry exactly, with an error naming what is supported where; Qwen-VL images still go through.

Neither engine is needed: VLLMServer is built without its engine (the refusal comes before vLLM
is imported or called; vLLM is not installed here) and SGLangServer runs on its stand-in.
"""

from __future__ import annotations

import asyncio
import itertools
import sys
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
Image = pytest.importorskip("PIL.Image")

from agentloop_core.protocol import CapabilityNotSupportedError, SamplingParams  # noqa: E402
from agentloop_core.testing.vision_engines import noise_picture as _picture  # noqa: E402
from agentloop_core.tokenization import ChatRenderer, Trajectory  # noqa: E402
from agentloop_core.vision import ImageItem, TiledImageItem, load_vision_processor, multi_modal_kwargs  # noqa: E402
from agentloop_engines.adapters.placeholders import refuse_tiled_images  # noqa: E402
from agentloop_engines.adapters.sglang.server import SGLangServer  # noqa: E402
from agentloop_engines.adapters.vllm.server import VLLMServer  # noqa: E402
from agentloop_engines.testing import StandInSGLangEngine  # noqa: E402
from agentloop_engines.testing.tiny_vlm import build_tiny_vlm  # noqa: E402

GREEDY = {"max_tokens": 3, "temperature": 0, "ignore_eos": True}
SUPPORTED = ("Qwen-VL family", "HFServer", "Idefics3/SmolVLM")



def _trajectory(path: str, *sizes: tuple[int, int]) -> Trajectory:
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    renderer = ChatRenderer(tokenizer, vision=load_vision_processor(path, tokenizer))
    parts = [{"type": "image", "image": _picture(w, h, k)} for k, (w, h) in enumerate(sizes)]
    return Trajectory(renderer, [{"role": "user", "content": [*parts, {"type": "text", "text": "What is it?"}]}])


@pytest.fixture(scope="module")
def idefics3_path() -> str:
    return str(build_tiny_vlm(family="idefics3"))


@pytest.fixture(scope="module")
def tiled(idefics3_path) -> Trajectory:
    """A 100x70 image: 2 x 2 tiles and the global view, 5 runs of 4 image tokens."""
    t = _trajectory(idefics3_path, (100, 70))
    assert [item.run_lengths for item in t.image_items] == [(4,) * 5]
    assert all(isinstance(item, TiledImageItem) for item in t.image_items)
    return t


def _assert_refusal(exc: BaseException, engine: str) -> None:
    message = str(exc)
    assert f"{engine} cannot take image 0 (sha256:" in message
    assert "fills 5 runs of image tokens (2 x 2 tiles and a global view" in message
    assert all(word in message for word in SUPPORTED), message


def test_refuse_tiled_images_names_the_first_tiled_image_and_what_is_supported(tiled):
    one_run = ImageItem(image=None, digest="sha256:" + "a" * 32, num_tokens=4)
    refuse_tiled_images([one_run], "VLLMServer")  # an image read as one run goes through
    with pytest.raises(CapabilityNotSupportedError) as caught:
        refuse_tiled_images([*tiled.image_items, one_run], "VLLMServer")
    _assert_refusal(caught.value, "VLLMServer")


def _engineless_vllm(image_token_id: int) -> tuple[VLLMServer, list]:
    """A VLLMServer without vLLM: an engine whose generate records each call (nothing may reach it)."""
    calls: list = []

    async def generate(**kwargs):
        calls.append(kwargs)
        yield None

    server = VLLMServer.__new__(VLLMServer)
    server.image_token_id = image_token_id
    server.engine = SimpleNamespace(generate=generate)
    server._seq = itertools.count()
    server._rids = {}
    server._vllm = SimpleNamespace(SamplingParams=lambda **kwargs: kwargs)
    server._ban = {}
    return server, calls


def test_vllm_refuses_a_tiled_image_before_building_its_prompt(tiled):
    """VLLMServer collapses each run of image tokens to one placeholder for vLLM to expand: for
    a tiled image that would drop the tiles' text and re-expand each tile as a whole image. So
    the request fails with the refusal before vLLM is imported or its engine called. Debug:
    VLLMServer._prompt and placeholders.refuse_tiled_images."""
    server, calls = _engineless_vllm(tiled.renderer.vision.image_token_id)

    async def run() -> None:
        async for _ in server._outputs("r", tiled.context_ids, SamplingParams(max_tokens=3), tiled.image_items):
            pass

    with pytest.raises(CapabilityNotSupportedError) as caught:
        asyncio.run(run())
    _assert_refusal(caught.value, "VLLMServer")
    assert calls == []
    assert server._rids == {}


def test_vllm_still_takes_qwen_vl_images_to_vllm(monkeypatch):
    """A Qwen-VL image (one run) is not refused: its run is collapsed to one placeholder in the
    ``TokensPrompt`` (vLLM's class stood in by a recorder: vLLM is not installed here)."""
    t = _trajectory(str(build_tiny_vlm()), (56, 56))
    vision = t.renderer.vision
    assert vision is not None
    server, _ = _engineless_vllm(vision.image_token_id)
    inputs = SimpleNamespace(TokensPrompt=lambda **kwargs: kwargs)
    monkeypatch.setitem(sys.modules, "vllm", SimpleNamespace(inputs=inputs))
    monkeypatch.setitem(sys.modules, "vllm.inputs", inputs)
    prompt = server._prompt(t.context_ids, tuple(t.image_items))
    (item,) = t.image_items
    assert prompt["prompt_token_ids"].count(vision.image_token_id) == 1
    assert len(prompt["prompt_token_ids"]) == len(t.context_ids) - item.num_tokens + 1
    assert prompt["multi_modal_data"] == {"image": [item.image]}


def test_sglang_refuses_a_tiled_image_before_sglang_sees_it(idefics3_path, tiled):
    """SGLangServer sends one ``image_data`` entry per run of image tokens: a tiled image's five
    runs would read as five images. Refused before the (stand-in) engine is called; a text
    request on the same server is served."""
    engine = StandInSGLangEngine(idefics3_path)
    server = SGLangServer(engine, tokenizer=transformers.AutoTokenizer.from_pretrained(idefics3_path))

    async def run():
        assert server.capabilities.vision
        calls = len(engine.calls)
        with pytest.raises(CapabilityNotSupportedError) as caught:
            await server.generate("tiled", tiled.context_ids, GREEDY, **multi_modal_kwargs(tiled.image_items))
        assert len(engine.calls) == calls
        text = await server.generate("text", [5, 6, 7], GREEDY)
        await server.close()
        return caught.value, text

    try:
        refusal, text = asyncio.run(run())
    finally:
        engine.loop.close()
    _assert_refusal(refusal, "SGLangServer")
    assert len(text.token_ids) == GREEDY["max_tokens"]
