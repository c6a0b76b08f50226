"""Tiled images (Idefics3/SmolVLM) through the gateway: the tiny Idefics3 model on a real
HFServer, driven by the stock ``openai`` client over HTTP (uvicorn on 127.0.0.1 in a thread).

An image fills several runs of image tokens here (one per tile and one for the global view,
the tiles' names between them), so what test_gateway_vision.py checks for Qwen-VL's single run
is checked again: a chat request's ``image_url`` data URL renders to exactly the prompt core's
:class:`Trajectory` renders, the engine gets that image, the recording keeps it; and a
conversation that continues with a second image is one token-exact training row.
"""

from __future__ import annotations

import asyncio

import pytest

openai = pytest.importorskip("openai", reason='gateway tests need the openai client: pip install "agentloop-engines[test]"')
pytest.importorskip("fastapi", reason='HTTP tests need: pip install "agentloop-engines[server]"')
pytest.importorskip("uvicorn", reason='HTTP tests need: pip install "agentloop-engines[server]"')
pytest.importorskip("torch", reason='HFServer needs pip install "agentloop-engines[hf]"')
pytest.importorskip("transformers", reason='HFServer needs pip install "agentloop-engines[hf]"')
Image = pytest.importorskip("PIL.Image")

from vision_checks import image_part, rebuilt_by_core, token_runs, two_turns_with_an_image_each  # noqa: E402

from agentloop_core.testing.vision_engines import noise_picture as picture  # noqa: E402
from agentloop_core.tokenization import ChatRenderer, Trajectory  # noqa: E402
from agentloop_core.vision import Idefics3Processor, image_token_runs, load_vision_processor  # noqa: E402
from agentloop_engines.adapters.hf import HFServer  # noqa: E402
from agentloop_engines.serving.gateway import Gateway, GatewayThread  # noqa: E402
from agentloop_engines.testing.tiny_vlm import build_tiny_vlm  # noqa: E402

KEY = "idefics3-key"
GREEDY = {"max_tokens": 5, "temperature": 0.0}



@pytest.fixture(scope="module")
def vlm_path():
    return build_tiny_vlm(family="idefics3", initializer_range=0.3)


@pytest.fixture(scope="module")
def server(vlm_path):
    return HFServer(vlm_path, max_batch_size=4)


@pytest.fixture(scope="module")
def processor(server, vlm_path):
    return load_vision_processor(vlm_path, server.tokenizer)


@pytest.fixture(scope="module")
def gateway(server):
    return Gateway(server, server.tokenizer, model_name="tiny-idefics3")


@pytest.fixture(scope="module")
def thread(gateway):
    with GatewayThread(gateway, api_key=KEY) as t:
        yield t


def test_a_chat_request_with_a_tiled_image_records_the_exact_tokens_and_the_image(thread, gateway, server, processor):
    """A 100x70 image (2 x 2 tiles + global view, 5 runs of 4 tokens): the gateway loads the
    Idefics3 processor, the prompt is core's render with the tiles' text between the runs, the
    engine's tokens and log-probs are what it gives for that prompt and image, and the recording
    names the image. Debug: gateway/images.py (the processor) and chat_planner.py (the render)."""
    assert isinstance(gateway.images.vision, Idefics3Processor)
    image = picture(100, 70, 0)
    messages = [{"role": "user", "content": [{"type": "text", "text": "What is in the picture?"}, image_part(image)]}]
    r = openai.OpenAI(base_url=thread.session_url("tiled-a"), api_key=KEY, max_retries=0, timeout=120
                      ).chat.completions.create(model="m", messages=messages, **GREEDY)
    (call,) = gateway.close_session("tiled-a")

    expected = processor.process(image)
    assert expected.run_lengths == (4,) * 5
    assert [item.digest for item in call.images] == [expected.digest]
    assert [item.run_lengths for item in call.images] == [expected.run_lengths]
    reference = Trajectory(ChatRenderer(server.tokenizer, vision=processor), messages)
    assert call.prompt_ids == r.prompt_token_ids == reference.prompt_ids
    assert token_runs(call.prompt_ids, processor.image_token_id) == [4] * 5
    ((start, end),) = image_token_runs(call.prompt_ids, call.images, processor.image_token_id)
    between = server.tokenizer.decode(call.prompt_ids[start:end])
    assert "<row_1_col_2>" in between
    assert "<global-img>" in between
    direct = asyncio.run(server.generate("direct-tiled", call.prompt_ids, {**GREEDY, "logprobs": True},
                                         multi_modal_data={"image": list(call.images)}))
    assert r.choices[0].token_ids == call.token_ids == direct.token_ids
    assert call.log_probs == pytest.approx(direct.log_probs, abs=1e-5)
    assert "base64" not in str(call.request)
    assert call.as_dict()["images"] == [{"digest": expected.digest, "size": [100, 70], "num_tokens": 20}]


async def test_a_conversation_that_continues_with_a_second_tiled_image_is_one_exact_row(server, processor):
    """Turn 1 with a 2 x 2 image, turn 2 adds a 1 x 2 image: one segment whose prompt and
    response hold each image's runs (mask 0), equal to core's Trajectory over the same messages,
    and the strict sanity check passes. Debug: gateway/continuation.py."""
    first, second = picture(100, 70, 1), picture(128, 40, 2)
    out, sent = await two_turns_with_an_image_each(server, processor, first, second, max_tokens=5)
    assert out.multi_modal_data is not None
    items = out.multi_modal_data["image"]
    assert [item.digest for item in items] == [processor.process(first).digest, processor.process(second).digest]
    token = processor.image_token_id
    assert token_runs(out.prompt_ids, token) == list(items[0].run_lengths) == [4] * 5
    assert token_runs(out.response_ids, token) == list(items[1].run_lengths) == [4] * 3
    assert all(m == 0 for t, m in zip(out.response_ids, out.response_mask, strict=True) if t == token)

    trajectory = rebuilt_by_core(server, processor, out, sent)
    assert trajectory.prompt_ids == out.prompt_ids
    assert trajectory.response_ids == out.response_ids
    assert list(trajectory.response_mask) == out.response_mask
    trajectory.to_output(sanity_check="strict")
