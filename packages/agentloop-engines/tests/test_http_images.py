"""Images over the engine server's ``POST /generate``: a real HFServer on the tiny Qwen2-VL behind
uvicorn on 127.0.0.1 (ServerThread), driven by EngineHTTPClient, against the same checkpoint in
process.

What is checked: the server declares ``vision`` (and its image limits) in ``/health`` and
EngineHTTPClient reports it; a prompt with two images gives exactly the tokens and log-probs of the
in-process engine, whole, streamed and through ``LLMServerClient`` over the remote replica; a
resent image is encoded once. If the outputs differ, compare the ``ImageItem.features`` the
server rebuilt (``agentloop_engines.wire.images.GenerateImages``) with the client's: the
processor settings of the two sides differ, or the PNG round trip changed the pixels.
"""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("httpx", reason='HTTP tests need: pip install "agentloop-engines[server]"')
pytest.importorskip("fastapi", reason='HTTP tests need: pip install "agentloop-engines[server]"')
pytest.importorskip("uvicorn", reason='HTTP tests need: pip install "agentloop-engines[server]"')
pytest.importorskip("torch", reason='HFServer needs pip install "agentloop-engines[hf]"')
pytest.importorskip("transformers", reason='HFServer needs pip install "agentloop-engines[hf]"')
Image = pytest.importorskip("PIL.Image")

from agentloop_core.protocol import CapabilityNotSupportedError  # noqa: E402
from agentloop_core.testing.vision_engines import noise_picture as picture  # noqa: E402
from agentloop_core.tokenization import ChatRenderer, Trajectory  # noqa: E402
from agentloop_core.vision import load_vision_processor, multi_modal_kwargs  # noqa: E402
from agentloop_engines.adapters.hf import HFServer  # noqa: E402
from agentloop_engines.fleet.client import LLMServerClient  # noqa: E402
from agentloop_engines.fleet.http_client import EngineHTTPClient  # noqa: E402
from agentloop_engines.serving.server import ServerThread  # noqa: E402
from agentloop_engines.testing.tiny_vlm import build_tiny_vlm  # noqa: E402
from agentloop_engines.wire.images import encode_images  # noqa: E402

KEY = "vision-key"
GREEDY = {"max_tokens": 8, "temperature": 0.0, "ignore_eos": True}



@pytest.fixture(scope="module")
def vlm_path():
    return build_tiny_vlm(initializer_range=0.3)


@pytest.fixture(scope="module")
def local(vlm_path):
    """The in-process reference engine (its own instance: it runs on the test's event loops)."""
    return HFServer(vlm_path, max_batch_size=4)


@pytest.fixture(scope="module")
def thread(vlm_path):
    with ServerThread(HFServer(vlm_path, max_batch_size=4), api_key=KEY) as t:
        yield t


@pytest.fixture(scope="module")
def trajectory(local, vlm_path):
    renderer = ChatRenderer(local.tokenizer, vision=load_vision_processor(vlm_path, local.tokenizer))
    return Trajectory(renderer, [{"role": "user", "content": [
        {"type": "image", "image": picture(84, 56, 1)}, {"type": "text", "text": "Compare"},
        {"type": "image", "image": picture(112, 84, 2)}, {"type": "text", "text": "these two."}]}])


def test_the_server_declares_vision_and_its_limits_and_remote_server_reports_it(thread):
    import httpx

    assert EngineHTTPClient(thread.url, api_key=KEY).capabilities.vision  # read from /health
    health = httpx.get(f"{thread.url}/health").json()
    assert health["capabilities"]["vision"] is True
    assert health["images"] == {"accepted": True, "max_images": 32, "max_image_bytes": 20 * 2**20,
                                "max_image_pixels": 16_777_216}


async def test_a_prompt_with_images_over_http_equals_the_in_process_engine(local, thread, trajectory):
    ids, mm = trajectory.context_ids, multi_modal_kwargs(trajectory.image_items)
    assert len(mm["multi_modal_data"]["image"]) == 2
    want = await local.generate("ref", ids, GREEDY, **mm)
    async with EngineHTTPClient(thread.url, api_key=KEY) as remote:
        got = await remote.generate("http", ids, GREEDY, **mm)
        streamed, last = [], None
        async for delta in remote.generate_stream("http-stream", ids, GREEDY, **mm):
            streamed += delta.token_ids
            last = delta
        client = LLMServerClient([remote])
        routed = await client.generate("routed", ids, GREEDY, **mm)
    assert len(want.token_ids) == 8
    assert got.token_ids == want.token_ids
    assert got.log_probs == want.log_probs  # JSON floats round-trip exactly
    assert streamed == want.token_ids
    assert last is not None
    assert last.output is not None
    assert last.output.log_probs == want.log_probs
    assert routed.token_ids == want.token_ids
    assert routed.log_probs == want.log_probs


def test_an_image_resent_every_turn_is_encoded_once(trajectory):
    items = trajectory.image_items
    first = encode_images(items)
    again = encode_images(items)
    assert [a is b for a, b in zip(first, again, strict=True)] == [True, True]
    assert [w["digest"] for w in first] == [i.digest for i in items]
    assert [w["num_tokens"] for w in first] == [i.num_tokens for i in items]


async def test_remote_server_refuses_images_for_a_text_only_server_before_sending(model_path, trajectory):
    with ServerThread(HFServer(model_path, max_model_len=256), api_key=KEY) as text_thread:
        async with EngineHTTPClient(text_thread.url, api_key=KEY) as remote:
            assert not remote.capabilities.vision
            with pytest.raises(CapabilityNotSupportedError, match="reads text only"):
                await remote.generate("img", [1, 2, 3], GREEDY, **multi_modal_kwargs(trajectory.image_items))
            assert (await remote.generate("txt", [1, 2, 3], GREEDY)).token_ids


def test_generate_with_images_runs_on_successive_event_loops(thread, trajectory):
    """The PNG encoding pool and the connections follow the loop, as for text requests."""
    remote = EngineHTTPClient(thread.url, api_key=KEY)
    mm = multi_modal_kwargs(trajectory.image_items)

    async def once(tag: str):
        try:
            return (await remote.generate(tag, trajectory.context_ids, GREEDY, **mm)).token_ids
        finally:
            await remote.close()

    assert asyncio.run(once("a")) == asyncio.run(once("b"))


def test_a_gateway_over_a_remote_replica_serves_an_image_chat_as_over_the_in_process_engine(local, thread):
    """What the images over /generate are for: a gateway (or trainer) in front of remote replicas
    answers a chat request with an image (it was a 400: the replicas did not declare vision)."""
    openai = pytest.importorskip("openai", reason='needs the openai client: pip install "agentloop-engines[test]"')
    import base64
    import io

    from agentloop_engines.serving.gateway import Gateway, GatewayThread

    buffer = io.BytesIO()
    picture(112, 84, 5).save(buffer, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
    messages = [{"role": "user", "content": [{"type": "text", "text": "What is it?"},
                                             {"type": "image_url", "image_url": {"url": url}}]}]
    answers = []
    for server in (LLMServerClient([EngineHTTPClient(thread.url, api_key=KEY)]), local):
        with GatewayThread(Gateway(server, local.tokenizer, model_name="m"), api_key="gw") as gw:
            chat = openai.OpenAI(base_url=gw.base_url, api_key="gw", max_retries=0, timeout=120)
            answers.append(chat.chat.completions.create(model="m", messages=messages, max_tokens=6, temperature=0))
    remote_answer, local_answer = answers
    assert remote_answer.choices[0].token_ids == local_answer.choices[0].token_ids
    assert remote_answer.choices[0].message.content == local_answer.choices[0].message.content
    assert remote_answer.prompt_token_ids == local_answer.prompt_token_ids
