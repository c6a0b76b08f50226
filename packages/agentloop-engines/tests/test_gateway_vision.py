"""Images through the gateway: the tiny Qwen2-VL model on a real HFServer, driven by the stock
``openai`` client over HTTP (uvicorn on 127.0.0.1 in a thread).

What is checked: a chat request's ``image_url`` part is rendered with the model's vision
processor (the prompt holds the image's token run), the engine gets exactly that image, and
the recording keeps it; a two-turn conversation with an image per turn continues token-exactly
and becomes one training row whose images are both, in order, agreeing with core's
:class:`Trajectory`; streaming takes the same path; and what a client may not send (remote
URLs, corrupt data, decompression bombs, too many images, images to a text-only model) is a
400 naming the reason, after which the server keeps serving.
"""

from __future__ import annotations

import asyncio
import base64

import pytest

openai = pytest.importorskip("openai", reason='gateway tests need the openai client: pip install "agentloop-engines[test]"')
pytest.importorskip("fastapi", reason='HTTP tests need: pip install "agentloop-engines[server]"')
pytest.importorskip("uvicorn", reason='HTTP tests need: pip install "agentloop-engines[server]"')
pytest.importorskip("torch", reason='HFServer needs pip install "agentloop-engines[hf]"')
pytest.importorskip("transformers", reason='HFServer needs pip install "agentloop-engines[hf]"')
Image = pytest.importorskip("PIL.Image")

from vision_checks import image_part, rebuilt_by_core, token_runs, two_turns_with_an_image_each  # noqa: E402

from agentloop_core.testing.vision_engines import bomb_png  # noqa: E402
from agentloop_core.testing.vision_engines import noise_picture as picture  # noqa: E402
from agentloop_core.tokenization import ChatRenderer, Trajectory  # noqa: E402
from agentloop_core.vision import load_vision_processor  # noqa: E402
from agentloop_engines.adapters.hf import HFServer  # noqa: E402
from agentloop_engines.serving.gateway import Gateway, GatewayThread  # noqa: E402
from agentloop_engines.testing.tiny_vlm import build_tiny_vlm  # noqa: E402

KEY = "vision-key"
GREEDY = {"max_tokens": 6, "temperature": 0.0}
MAX_IMAGES = 3



def png_bytes_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


@pytest.fixture(scope="module")
def vlm_path():
    return build_tiny_vlm(initializer_range=0.3)


@pytest.fixture(scope="module")
def server(vlm_path):
    return HFServer(vlm_path, max_batch_size=4)


@pytest.fixture(scope="module")
def processor(server, vlm_path):
    return load_vision_processor(vlm_path, server.tokenizer)


@pytest.fixture(scope="module")
def gateway(server):
    # vision="auto": the processor comes from the folder the tokenizer was loaded from.
    return Gateway(server, server.tokenizer, model_name="tiny-vlm", max_images=MAX_IMAGES)


@pytest.fixture(scope="module")
def thread(gateway):
    with GatewayThread(gateway, api_key=KEY) as t:
        yield t


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url, api_key=KEY, max_retries=0, timeout=120)


def test_the_gateway_loads_the_vision_processor_of_the_checkpoint(gateway, processor):
    assert gateway.images.vision is not None
    assert gateway.images.vision.image_token_id == processor.image_token_id


def test_a_chat_request_with_an_image_records_the_exact_tokens_and_the_image(thread, gateway, server, processor):
    image = picture(112, 112, 0)
    messages = [{"role": "user", "content": [{"type": "text", "text": "What is in the picture?"}, image_part(image)]}]
    r = client(thread.session_url("vision-a")).chat.completions.create(model="m", messages=messages, **GREEDY)
    (call,) = gateway.close_session("vision-a")

    expected = processor.process(image)
    assert expected.num_tokens == 16  # 112x112: an 8x8 grid of patches, merged 2x2
    assert [item.digest for item in call.images] == [expected.digest]
    assert [item.num_tokens for item in call.images] == [16]
    # The prompt: the chat template's render, its one placeholder expanded to the image's 16 tokens.
    reference = Trajectory(ChatRenderer(server.tokenizer, vision=processor), messages)
    assert call.prompt_ids == r.prompt_token_ids == reference.prompt_ids
    assert token_runs(call.prompt_ids, processor.image_token_id) == [16]
    start = call.prompt_ids.index(processor.image_token_id)
    assert server.tokenizer.convert_ids_to_tokens(call.prompt_ids[start - 1]) == "<|vision_start|>"
    assert server.tokenizer.convert_ids_to_tokens(call.prompt_ids[start + 16]) == "<|vision_end|>"
    # The completion is what the engine generates for this prompt with this image.
    direct = asyncio.run(server.generate("direct-a", call.prompt_ids, {**GREEDY, "logprobs": True},
                                         multi_modal_data={"image": list(call.images)}))
    assert r.choices[0].token_ids == call.token_ids == direct.token_ids
    assert call.log_probs == pytest.approx(direct.log_probs, abs=1e-5)
    assert r.choices[0].message.content == server.tokenizer.decode(call.token_ids, skip_special_tokens=True)
    # The recording holds the image, not its payload.
    assert "base64" not in str(call.request)
    assert call.as_dict()["images"] == [{"digest": expected.digest, "size": [112, 112], "num_tokens": 16}]


def test_a_streamed_chat_with_an_image_takes_the_same_path(thread, gateway, server, processor):
    image = picture(84, 140, 3)
    messages = [{"role": "user", "content": [image_part(image), {"type": "text", "text": "Describe it."}]}]
    chunks = list(client(thread.session_url("vision-stream")).chat.completions.create(
        model="m", messages=messages, stream=True, **GREEDY))
    (call,) = gateway.close_session("vision-stream")
    assert [item.digest for item in call.images] == [processor.process(image).digest]
    assert token_runs(call.prompt_ids, processor.image_token_id) == [call.images[0].num_tokens]
    last = [ch for ch in chunks if ch.choices][-1]
    assert last.choices[0].model_extra["token_ids"] == call.token_ids
    direct = asyncio.run(server.generate("direct-stream", call.prompt_ids, GREEDY,
                                         multi_modal_data={"image": list(call.images)}))
    assert call.token_ids == direct.token_ids
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == server.tokenizer.decode(call.token_ids, skip_special_tokens=True)


async def test_a_two_turn_conversation_with_an_image_per_turn_is_one_row_with_both_images(server, processor):
    first, second = picture(112, 84, 1), picture(56, 112, 2)
    out, sent = await two_turns_with_an_image_each(server, processor, first, second, max_tokens=6)
    items = out.multi_modal_data["image"]
    assert [item.digest for item in items] == [processor.process(first).digest, processor.process(second).digest]
    token = processor.image_token_id
    assert token_runs(out.prompt_ids, token) == [items[0].num_tokens]
    assert token_runs(out.response_ids, token) == [items[1].num_tokens]
    assert all(m == 0 for t, m in zip(out.response_ids, out.response_mask, strict=True) if t == token)

    # Consistency: core's Trajectory over the same messages and the engine's ids builds the same row,
    # and its sanity check (the template over the whole conversation) passes.
    trajectory = rebuilt_by_core(server, processor, out, sent)
    assert trajectory.prompt_ids == out.prompt_ids
    assert trajectory.response_ids == out.response_ids
    assert list(trajectory.response_mask) == out.response_mask
    assert [item.digest for item in trajectory.image_items] == [item.digest for item in items]
    trajectory.to_output(sanity_check="strict")


BAD_IMAGES = [
    pytest.param("https://example.com/cat.png", "allow_remote_image_urls=True", id="remote-url"),
    pytest.param(png_bytes_url(b"this is not a PNG file at all"), "not a readable image", id="corrupt"),
    pytest.param(png_bytes_url(bomb_png()), "max_image_pixels", id="decompression-bomb"),
    pytest.param("data:text/plain;base64,aGVsbG8=", "only image/* is an image", id="not-an-image"),
    pytest.param("file:///etc/hostname", "file path is not accepted", id="file-url"),
    pytest.param("/etc/hostname", "file path is not accepted", id="path"),
]


@pytest.mark.parametrize(("url", "reason"), BAD_IMAGES)
def test_a_refused_image_is_a_400_naming_the_reason_and_the_server_keeps_serving(thread, url, reason):
    c = client(thread.base_url)
    bad = [{"role": "user", "content": [{"type": "text", "text": "See:"}, {"type": "image_url",
                                                                          "image_url": {"url": url}}]}]
    with pytest.raises(openai.BadRequestError) as caught:
        c.chat.completions.create(model="m", messages=bad, **GREEDY)
    assert caught.value.status_code == 400
    assert reason in caught.value.message
    assert "messages[0].content[1]" in caught.value.message
    good = [{"role": "user", "content": [{"type": "text", "text": "See:"}, image_part(picture(56, 56, 9))]}]
    assert c.chat.completions.create(model="m", messages=good, **GREEDY).choices[0].token_ids


def test_more_images_than_max_images_is_a_400(thread):
    c = client(thread.session_url("vision-many"))
    images = [image_part(picture(56, 56, k)) for k in range(MAX_IMAGES + 1)]
    with pytest.raises(openai.BadRequestError, match="max_images"):
        c.chat.completions.create(model="m", messages=[{"role": "user", "content": images}], **GREEDY)
    r = c.chat.completions.create(model="m", messages=[{"role": "user", "content": images[:MAX_IMAGES]}], **GREEDY)
    assert r.choices[0].token_ids


def test_an_image_sent_to_a_text_only_model_is_a_400(model_path):
    text_server = HFServer(model_path, max_model_len=256)
    gateway = Gateway(text_server, text_server.tokenizer)
    assert gateway.images.vision is None
    with GatewayThread(gateway, api_key=KEY) as t:
        c = client(t.base_url)
        with pytest.raises(openai.BadRequestError, match="reads text only") as caught:
            c.chat.completions.create(model="m", messages=[{"role": "user", "content": [
                {"type": "text", "text": "What is this?"}, image_part(picture(56, 56, 0))]}], **GREEDY)
        assert "text-only checkpoint" in caught.value.message
        assert c.chat.completions.create(model="m", messages=[{"role": "user", "content": "Hi"}],
                                         **GREEDY).choices[0].token_ids
