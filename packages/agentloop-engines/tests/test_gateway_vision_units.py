"""Images through the gateway without a model: a ScriptedServer standing in for a vision engine
(it records the images each call carried) and the tiny tokenizer with Qwen2-VL's vision tokens
and image processor. Fast checks of what the HF tests cannot reach: a tool result carrying an
image, each segment's own images, decoding once per session, what the limits count, and what
is refused before anything is decoded."""

from __future__ import annotations

import base64
import io
import json

import pytest

pytest.importorskip("transformers")
Image = pytest.importorskip("PIL.Image")

from agentloop_core.testing import ScriptedServer  # noqa: E402
from agentloop_core.testing.tiny_vision import tiny_vision_processor  # noqa: E402
from agentloop_core.testing.vision_engines import noise_picture as picture  # noqa: E402
from agentloop_core.vision import decode_image  # noqa: E402
from agentloop_engines.serving.gateway import Gateway, PromptLimitError, PromptLimits  # noqa: E402
from agentloop_engines.serving.gateway import images as gateway_images  # noqa: E402
from agentloop_engines.serving.http_agent import HTTPAgentConfig, HTTPAgentLoop, close_gateways  # noqa: E402
from agentloop_engines.testing.gateway_fixtures import scripted as scripted_server  # noqa: E402

CALC = {"type": "function", "function": {"name": "zoom", "description": "Zoom into the picture.",
                                         "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}}}}



def data_url(image) -> str:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def image_part(image) -> dict:
    return {"type": "image_url", "image_url": {"url": data_url(image), "detail": "high"}}


@pytest.fixture(scope="module")
def vision():
    return tiny_vision_processor()


@pytest.fixture
def tok(vision):
    return vision[0]


@pytest.fixture
def processor(vision):
    return vision[1]


def scripted(tok, texts: list[str], *, vision: bool = True) -> ScriptedServer:
    """The k-th call of each session gets the k-th reply (the last one past the script)."""
    return scripted_server(tok, texts, repeat_last=True, vocab_size=len(tok), vision=vision)


def digests(items) -> list[str]:
    return [item.digest for item in items]


async def test_a_tool_result_with_an_image_continues_the_call_and_the_engine_gets_both_images(tok, processor):
    first, crop = picture(112, 84, 1), picture(56, 56, 2)
    server = scripted(tok, ['<tool_call>\n{"name": "zoom", "arguments": {"x": 3}}\n</tool_call>', "A cat."])
    gateway = Gateway(server, tok, vision=processor, tool_parser="hermes")
    messages = [{"role": "user", "content": [{"type": "text", "text": "What is it?"}, image_part(first)]}]
    r1 = (await gateway.chat_completion({"messages": messages, "tools": [CALC]}, session_id="s")).body
    message = r1["choices"][0]["message"]
    assert message["tool_calls"]
    messages += [message, {"role": "tool", "tool_call_id": message["tool_calls"][0]["id"],
                           "content": [{"type": "text", "text": "Zoomed:"}, image_part(crop)]}]
    r2 = (await gateway.chat_completion({"messages": messages, "tools": [CALC]}, session_id="s")).body
    calls = gateway.close_session("s")
    assert calls[1].extra["extends_previous"]
    assert r2["prompt_token_ids"][: len(calls[0].prompt_ids) + len(calls[0].token_ids)] == \
        calls[0].prompt_ids + calls[0].token_ids
    expected = [processor.process(first).digest, processor.process(crop).digest]
    assert digests(server.calls[0].images) == expected[:1]
    assert digests(server.calls[1].images) == expected
    assert digests(calls[1].images) == expected
    token = processor.image_token_id
    assert r2["prompt_token_ids"].count(token) == sum(item.num_tokens for item in calls[1].images)
    assert gateway.images.decoded == 2


async def test_each_segment_holds_its_own_images_and_a_resent_image_is_decoded_once(tok, processor, monkeypatch):
    a, b = picture(112, 112, 3), picture(84, 56, 4)
    decoded: list[str] = []

    def counting_decode(source, limits=None, *, where="image"):
        decoded.append(where)
        return decode_image(source, limits, where=where)

    monkeypatch.setattr(gateway_images, "decode_image", counting_decode)

    def agent(base_url: str, row: dict) -> None:
        import openai

        c = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=60)
        messages = [{"role": "user", "content": [image_part(a), {"type": "text", "text": "one"}]}]
        reply = c.chat.completions.create(model="any", messages=messages)
        messages += [reply.choices[0].message.model_dump(exclude_none=True),
                     {"role": "user", "content": [image_part(b), {"type": "text", "text": "two"}]}]
        c.chat.completions.create(model="any", messages=messages)
        # The agent rewrites its context: a new segment, holding image b alone.
        c.chat.completions.create(model="any", messages=[
            {"role": "user", "content": [{"type": "text", "text": "Summary:"}, image_part(b)]}])

    pytest.importorskip("openai")
    server = scripted(tok, ["First.", "Second.", "Third."])
    loop = HTTPAgentLoop(server, tok, {"agent": agent}, processor=processor)
    try:
        outputs = await loop.run({"temperature": 1.0, "max_tokens": 8}, index=1)
    finally:
        close_gateways()
    assert len(outputs) == 2
    pa, pb = processor.process(a).digest, processor.process(b).digest
    assert digests(outputs[0].multi_modal_data["image"]) == [pa, pb]
    assert digests(outputs[1].multi_modal_data["image"]) == [pb]
    token = processor.image_token_id
    for out in outputs:
        n = sum(item.num_tokens for item in out.multi_modal_data["image"])
        assert (out.prompt_ids + out.response_ids).count(token) == n
    assert digests(server.calls[2].images) == [pb]
    # a once, b once: b's second sending (in the rewritten context) came from the session's decoded images.
    assert decoded == ["messages[0].content[0]", "messages[2].content[0]"]


async def test_a_text_agent_output_has_no_images(tok):
    def agent(base_url: str, row: dict) -> None:
        import openai

        openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0).chat.completions.create(
            model="any", messages=[{"role": "user", "content": "Hi"}])

    pytest.importorskip("openai")
    try:
        (out,) = await HTTPAgentLoop(scripted(tok, ["Hello."], vision=False), tok, {"agent": agent}).run(
            {"max_tokens": 8}, index=2)
    finally:
        close_gateways()
    assert out.multi_modal_data is None


async def test_an_image_sent_twice_in_one_request_is_decoded_once_and_read_twice(tok, processor):
    server = scripted(tok, ["Same."])
    gateway = Gateway(server, tok, vision=processor)
    image = image_part(picture(56, 84, 5))
    body = {"messages": [{"role": "user", "content": [image, {"type": "text", "text": "and"}, image]}]}
    r = (await gateway.chat_completion(body)).body
    assert gateway.images.decoded == 1
    (call,) = server.calls
    assert len(call.images) == 2
    assert call.images[0].digest == call.images[1].digest
    assert r["prompt_token_ids"].count(processor.image_token_id) == 2 * call.images[0].num_tokens


async def test_image_urls_do_not_count_as_prompt_text_but_text_still_does(tok, processor):
    gateway = Gateway(scripted(tok, ["Ok."]), tok, vision=processor, prompt_limits=PromptLimits(max_prompt_chars=2000))
    image = image_part(picture(120, 120, 6))
    assert len(image["image_url"]["url"]) > 20_000
    await gateway.chat_completion({"messages": [{"role": "user", "content": [image]}]})
    with pytest.raises(PromptLimitError, match="max_prompt_chars"):
        await gateway.chat_completion({"messages": [{"role": "user", "content": [image, {"type": "text",
                                                                                         "text": "x" * 3000}]}]})


async def test_a_session_records_digests_not_image_payloads(tok, processor):
    gateway = Gateway(scripted(tok, ["Ok."]), tok, vision=processor)
    image = picture(56, 56, 7)
    await gateway.chat_completion({"messages": [{"role": "user", "content": [image_part(image)]}]}, session_id="r")
    (call,) = gateway.close_session("r")
    text = json.dumps(call.as_dict())  # what GET /sessions/<id> returns: JSON, no pixels, no base64
    assert "base64" not in text
    digest = processor.process(image).digest
    assert json.loads(text)["images"] == [{"digest": digest, "size": [56, 56], "num_tokens": call.images[0].num_tokens}]
    assert call.request["messages"][0]["content"][0]["image_url"]["url"].startswith("<image sha256:")


async def test_the_responses_api_image_form_is_accepted(tok, processor):
    server = scripted(tok, ["Ok."])
    gateway = Gateway(server, tok, vision=processor)
    url = data_url(picture(56, 56, 8))
    await gateway.chat_completion({"messages": [{"role": "user", "content": [
        {"type": "input_text", "text": "See"}, {"type": "input_image", "image_url": url}]}]})
    assert len(server.calls[0].images) == 1


@pytest.mark.parametrize(("message", "reason"), [
    ({"role": "system", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}]},
     "an image in a 'system' message"),
    ({"role": "user", "content": [{"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AA=="}}]},
     "videos are not supported"),
    ({"role": "user", "content": [{"type": "image_url", "image_url": {}}]}, "image part without a URL"),
    ({"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "AA=="}}]},
     "takes text and image_url parts"),
])
async def test_parts_the_gateway_cannot_serve_are_refused_before_decoding(tok, processor, message, reason):
    server = scripted(tok, ["Ok."])
    gateway = Gateway(server, tok, vision=processor)
    with pytest.raises(ValueError, match=reason):
        await gateway.chat_completion({"messages": [message, {"role": "user", "content": "Hi"}]})
    assert gateway.images.decoded == 0
    assert not server.calls


async def test_images_need_a_vision_processor_and_an_engine_with_the_vision_capability(tok, processor):
    body = {"messages": [{"role": "user", "content": [image_part(picture(56, 56, 0))]}]}
    text_engine = scripted(tok, ["Ok."], vision=False)
    with pytest.raises(ValueError, match="capabilities.vision"):
        await Gateway(text_engine, tok, vision=processor).chat_completion(body)
    with pytest.raises(ValueError, match=r"reads text only.*Gateway\(vision=None\)"):
        await Gateway(scripted(tok, ["Ok."]), tok, vision=None).chat_completion(body)
    assert not text_engine.calls
    # The tokenizer of a tiny tokenizer folder is no checkpoint: "auto" finds no processor, text still works.
    gateway = Gateway(scripted(tok, ["Ok."]), tok)
    assert gateway.images.vision is None
    await gateway.chat_completion({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                                             {"type": "text", "text": "b"}]}]})
    assert tok.decode(gateway.server.calls[0].prompt_ids).count("a\nb") == 1  # text parts joined as before


def test_http_agent_reads_its_image_limits():
    cfg = HTTPAgentConfig.from_mapping({"agent": print, "max_images": 2, "max_image_pixels": 4096,
                                        "allow_remote_image_urls": True})
    assert cfg.image_options == {"max_images": 2, "max_image_pixels": 4096, "max_image_bytes": 20 * 2**20,
                                 "allow_remote_image_urls": True}
    assert cfg.max_request_bytes == 8 * 2**20
    assert HTTPAgentConfig.from_mapping({"agent": print, "max_request_bytes": 2**26}).max_request_bytes == 2**26
    with pytest.raises(ValueError, match="max_image_bytes"):
        HTTPAgentConfig.from_mapping({"agent": print, "max_image_bytes": 0})
    with pytest.raises(ValueError, match="allow_remote_image_urls"):
        HTTPAgentConfig.from_mapping({"agent": print, "allow_remote_image_urls": "yes"})


def test_the_gateway_options_set_its_image_limits_and_never_allow_paths(tok, processor):
    gateway = Gateway(scripted(tok, ["Ok."]), tok, vision=processor, max_images=2, max_image_pixels=4096,
                      max_image_bytes=1000, allow_remote_image_urls=True)
    limits = gateway.images.limits
    assert (limits.max_images, limits.max_pixels, limits.max_bytes) == (2, 4096, 1000)
    assert limits.allow_remote_urls is True
    assert limits.allow_paths is False
    with pytest.raises(ValueError, match="max_image_pixels must be a positive integer"):
        Gateway(scripted(tok, ["Ok."]), tok, vision=processor, max_image_pixels=0)


async def test_remote_urls_are_fetched_only_when_allowed(tok, processor, tmp_path, monkeypatch):
    import http.server
    import threading

    for var in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY", "all_proxy", "ALL_PROXY"):
        monkeypatch.delenv(var, raising=False)
    image = picture(56, 84, 11)
    image.save(tmp_path / "cat.png")

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, directory=str(tmp_path), **kwargs)

        def log_message(self, *args):
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Quiet)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{httpd.server_address[1]}/cat.png"
    body = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}]}
    try:
        with pytest.raises(ValueError, match="allow_remote_image_urls=True"):
            await Gateway(scripted(tok, ["Ok."]), tok, vision=processor).chat_completion(body)
        server = scripted(tok, ["Ok."])
        await Gateway(server, tok, vision=processor, allow_remote_image_urls=True).chat_completion(body)
    finally:
        httpd.shutdown()
        httpd.server_close()
    assert digests(server.calls[0].images) == [processor.process(image.convert("RGB")).digest]
