"""What a client may not send as images to ``POST /generate`` (the tiny Qwen2-VL on a real
HFServer behind uvicorn on 127.0.0.1): corrupt bytes, invalid base64, a decompression bomb, more
images than ``max_images``, pixels that do not match their digest, a token count the server's
processor does not reproduce, and any image to a text-only engine. Each is a 400 naming the
reason, refused before the engine sees the request, streamed or not; the server then serves
the next request with images.

If one fails, read ``agentloop_engines.wire.images.GenerateImages.multi_modal`` (the checks,
in order: engine and processor, count, base64, bytes, header pixels, digest, token count).
"""

from __future__ import annotations

import base64
import io

import pytest

httpx = pytest.importorskip("httpx", reason='HTTP tests need: pip install "agentloop-engines[server]"')
pytest.importorskip("fastapi", reason='HTTP tests need: pip install "agentloop-engines[server]"')
pytest.importorskip("uvicorn", reason='HTTP tests need: pip install "agentloop-engines[server]"')
pytest.importorskip("torch", reason='HFServer needs pip install "agentloop-engines[hf]"')
pytest.importorskip("transformers", reason='HFServer needs pip install "agentloop-engines[hf]"')
Image = pytest.importorskip("PIL.Image")

from agentloop_core.testing.vision_engines import bomb_png  # noqa: E402
from agentloop_core.testing.vision_engines import noise_picture as picture  # noqa: E402
from agentloop_core.tokenization import ChatRenderer, Trajectory  # noqa: E402
from agentloop_core.vision import ImageLimits, load_vision_processor  # noqa: E402
from agentloop_engines.adapters.hf import HFServer  # noqa: E402
from agentloop_engines.serving.server import ServerThread  # noqa: E402
from agentloop_engines.testing.tiny_vlm import build_tiny_vlm  # noqa: E402
from agentloop_engines.wire.images import encode_images  # noqa: E402

KEY = "vision-key"
MAX_IMAGES = 2
GREEDY = {"max_tokens": 4, "temperature": 0.0}



def png(image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def vlm_path():
    return build_tiny_vlm(initializer_range=0.3)


@pytest.fixture(scope="module")
def engine(vlm_path):
    return HFServer(vlm_path, max_batch_size=4)


@pytest.fixture(scope="module")
def thread(engine):
    with ServerThread(engine, api_key=KEY, image_limits=ImageLimits(max_images=MAX_IMAGES, allow_paths=False)) as t:
        yield t


@pytest.fixture(scope="module")
def good(engine, vlm_path) -> dict:
    """A valid /generate body with one image."""
    renderer = ChatRenderer(engine.tokenizer, vision=load_vision_processor(vlm_path, engine.tokenizer))
    t = Trajectory(renderer, [{"role": "user", "content": [{"type": "image", "image": picture(56, 56, 3)},
                                                           {"type": "text", "text": "What is it?"}]}])
    return {"request_id": "good", "prompt_ids": t.context_ids, "sampling_params": GREEDY,
            "images": encode_images(t.image_items)}


def post(url: str, body: dict):
    return httpx.post(f"{url}/generate", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)


def with_image(good: dict, **changes) -> dict:
    return {**good, "images": [{**good["images"][0], **changes}]}


def assert_still_serves(url: str, good: dict) -> None:
    r = post(url, good)
    assert r.status_code == 200, r.text
    assert len(r.json()["token_ids"]) == GREEDY["max_tokens"]


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


BAD = [
    pytest.param({"data": b64(b"this is not an image at all" * 10)}, "not a readable image", id="corrupt-bytes"),
    pytest.param({"data": b64(png(picture(56, 56, 3))[:200])}, "images[0]", id="truncated-png"),
    pytest.param({"data": "%%% not base64 %%%"}, "not valid base64", id="bad-base64"),
    pytest.param({"data": b64(bomb_png())}, "max_image_pixels", id="decompression-bomb"),
    pytest.param({"data": b64(png(picture(56, 56, 4)))}, "digest", id="digest-mismatch"),
    pytest.param({"num_tokens": 5}, "makes 4 image tokens of it, the client's made 5", id="token-count-mismatch"),
    pytest.param({"data": 123}, "images.0.data", id="data-not-a-string"),
    pytest.param({"pixels": [1, 2, 3]}, "images.0.pixels", id="unknown-field"),
]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize(("change", "reason"), BAD)
def test_a_bad_image_is_a_400_naming_the_reason_and_the_server_keeps_serving(thread, good, change, reason, stream):
    r = post(thread.url, {**with_image(good, **change), "stream": stream})
    assert r.status_code == 400, r.text
    assert r.headers["content-type"].startswith("application/json")  # refused before the stream began
    assert reason in r.json()["error"]["message"]
    assert_still_serves(thread.url, good)


def test_more_images_than_max_images_is_a_400_before_any_is_decoded(thread, good):
    # Three copies of a corrupt image: the count is refused first, so none is decoded.
    corrupt = {"data": b64(b"junk"), "digest": "sha256:0", "num_tokens": 1}
    r = post(thread.url, {**good, "images": [corrupt] * (MAX_IMAGES + 1)})
    assert r.status_code == 400
    message = r.json()["error"]["message"]
    assert f"{MAX_IMAGES + 1} images" in message
    assert "max_images" in message
    assert_still_serves(thread.url, good)


def test_an_image_over_the_byte_limit_is_a_400_before_it_is_decoded(vlm_path, good):
    with ServerThread(HFServer(vlm_path), api_key=KEY, image_limits=ImageLimits(max_bytes=1000)) as t:
        r = post(t.url, good)
        assert r.status_code == 400
        assert "max_image_bytes" in r.json()["error"]["message"]


def test_images_to_a_text_only_engine_are_a_400_naming_why(model_path, good):
    text_engine = HFServer(model_path, max_model_len=256)
    with ServerThread(text_engine, api_key=KEY) as t:
        health = httpx.get(f"{t.url}/health").json()
        assert health["capabilities"]["vision"] is False
        assert "reads text only" in health["images"]["reason"]
        for stream in (False, True):
            r = post(t.url, {**good, "prompt_ids": [1, 2, 3], "stream": stream})
            assert r.status_code == 400
            assert "reads text only" in r.json()["error"]["message"]
        r = post(t.url, {"request_id": "txt", "prompt_ids": [1, 2, 3], "sampling_params": GREEDY})
        assert r.status_code == 200
        assert len(r.json()["token_ids"]) == GREEDY["max_tokens"]


def test_a_vision_engine_without_a_processor_refuses_images_naming_why(vlm_path, good):
    """An HFServer built from an in-memory model has no checkpoint folder to load the processor
    from: /generate cannot rebuild images, so it says so (and /health does not declare vision)."""
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(vlm_path)
    model = HFServer(vlm_path).model
    model.config._name_or_path = ""  # as a model built in memory has no folder
    tokenizer.name_or_path = ""
    engine = HFServer(model, tokenizer)
    assert engine.capabilities.vision
    with ServerThread(engine, api_key=KEY) as t:
        assert httpx.get(f"{t.url}/health").json()["capabilities"]["vision"] is False
        r = post(t.url, good)
        assert r.status_code == 400
        assert "no vision processor" in r.json()["error"]["message"]
