"""The conformance suite's recording proxy forwards and records a call's images: a vision loop
under it sees the engine it would see alone (before, the proxy dropped ``multi_modal_data`` and
the vision engine refused the prompt's image tokens)."""

from __future__ import annotations

import asyncio

from agentloop_conformance.recording import RecordingServer
from agentloop_core.testing import load_tiny_tokenizer
from agentloop_core.testing.vision_engines import VisionScriptedServer
from agentloop_core.vision.processor import ImageItem

IMAGE_TOKEN = 7


def test_recording_server_forwards_and_records_images() -> None:
    tok = load_tiny_tokenizer()
    engine = VisionScriptedServer(tok, ["seen"], image_token_id=IMAGE_TOKEN)
    proxy = RecordingServer(engine)
    image = ImageItem(image=None, digest="sha256:" + "0" * 32, num_tokens=3)
    prompt = [1, IMAGE_TOKEN, IMAGE_TOKEN, IMAGE_TOKEN, 2]
    data = {"image": [image]}

    out = asyncio.run(proxy.generate("r1", prompt, {"max_tokens": 4}, multi_modal_data=data))

    assert tok.decode(out.token_ids, skip_special_tokens=True) == "seen"
    assert engine.images == [(image,)]
    assert [c.multi_modal for c in proxy.calls] == [{"multi_modal_data": data}]


def test_recording_server_records_no_images_for_a_text_call() -> None:
    tok = load_tiny_tokenizer()
    proxy = RecordingServer(VisionScriptedServer(tok, ["plain"], image_token_id=IMAGE_TOKEN))
    asyncio.run(proxy.generate("r1", [1, 2, 3], {"max_tokens": 4}))
    assert proxy.calls[0].multi_modal is None
    assert proxy.calls[0].prompt_ids == [1, 2, 3]
