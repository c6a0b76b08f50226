"""Images in ``react_agent`` graphs on the tiny vision-language model (random Qwen2-VL).

The end-to-end test runs the real engine (HFServer): every prompt, with its images, goes to it
and it pairs each image's tokens with the image's features. A random model never writes a tool
call, so the first turns' text is forced (:class:`ForcedCalls`); the last turn is the engine's
own. The other tests check loop logic on a scripted engine with the tiny VLM's real tokenizer,
chat template and image processor; LangGraph, LangChain and the tools are real throughout.
"""

from __future__ import annotations

import base64
import io
from typing import Any

import pytest

pytest.importorskip("torch", reason="the tiny VLM needs torch (pip install \"agentloop-engines[hf]\")")
tiny_vlm = pytest.importorskip("agentloop_engines.testing.tiny_vlm", reason="agentloop-engines is not installed")

from langchain_core.messages import HumanMessage, ToolMessage  # noqa: E402
from langgraph_helpers import hermes_call  # noqa: E402
from PIL import Image  # noqa: E402

from agentloop_core.testing import ScriptedServer, load_tiny_tokenizer  # noqa: E402
from agentloop_core.testing.vision_engines import ForcedTurns as ForcedCalls  # noqa: E402
from agentloop_core.testing.vision_engines import VisionScriptedServer as VisionScripted  # noqa: E402
from agentloop_core.testing.vision_engines import gradient_picture as picture  # noqa: E402
from agentloop_core.vision import image_digest, load_vision_processor  # noqa: E402
from agentloop_langgraph import ReactAgentLoop  # noqa: E402
from agentloop_langgraph.messages import content_parts  # noqa: E402
from agentloop_tools.base import BaseTool  # noqa: E402
from agentloop_tools.function_tool import function_tool  # noqa: E402
from agentloop_tools.schema import ToolResponse  # noqa: E402
from agentloop_tools.tool_media import NO_VISION_FIX, VIDEO_REFUSAL  # noqa: E402

SAMPLING = {"temperature": 0.0, "logprobs": True}
TRIMMING = "langgraph_helpers:trimming_graph"


@pytest.fixture(scope="module")
def vlm():
    """``(folder, tokenizer, processor)`` of the tiny VLM."""
    import transformers

    folder = tiny_vlm.build_tiny_vlm()
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(folder))
    return folder, tokenizer, load_vision_processor(folder, tokenizer)


def b64png(image: Image.Image) -> str:
    buf = io.BytesIO()
    image.save(buf, "PNG")
    return base64.b64encode(buf.getvalue()).decode("ascii")


def user_with(block: dict[str, Any], text: str = "What is in the picture?") -> list[dict[str, Any]]:
    return [{"role": "user", "content": [block, {"type": "text", "text": text}]}]


def image_url_block(image: Image.Image) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": "data:image/png;base64," + b64png(image)}}


class Returns(BaseTool):
    """Returns ``responses[i]`` on its i-th call (the last one after that)."""

    def __init__(self, name: str, *responses: ToolResponse) -> None:
        super().__init__({}, {"type": "function", "function": {"name": name, "description": f"the {name} tool",
                                                               "parameters": {"type": "object", "properties": {}}}})
        self.responses = responses
        self.count = 0

    async def execute(self, instance_id, parameters, **kwargs):
        response = self.responses[min(self.count, len(self.responses) - 1)]
        self.count += 1
        return response, 0.0, {}


def loop_of(server, tokenizer, processor, tools, **config) -> ReactAgentLoop:
    config.setdefault("response_length", 4096)
    return ReactAgentLoop(server, tokenizer, {"tools": {t.name: t for t in tools}, "sanity_check": "strict", **config},
                          processor=processor)


def tool_contents(out) -> list[Any]:
    return [m["content"] for m in out.extra_fields["messages"] if m["role"] == "tool"]


def image_masks(out, image_token_id: int) -> list[int]:
    return [m for t, m in zip(out.response_ids, out.response_mask, strict=True) if t == image_token_id]


async def test_tool_images_reach_the_real_engine_and_the_output_in_order(vlm):
    from agentloop_engines.adapters.hf import HFServer

    folder, tokenizer, processor = vlm
    scene, crop_image, swatch_image = picture((64, 48)), picture((40, 40), seed=50), picture((40, 30), seed=99)

    @function_tool
    def crop(x: int):
        """Crop the picture.

        Args:
            x: Where to crop.
        """
        return f"cropped at {x}", crop_image

    @function_tool
    def swatch(color: str):
        """Show a colour swatch.

        Args:
            color: The colour's name.
        """
        return f"a {color} swatch", swatch_image

    server = HFServer(folder, seed=0)
    try:
        engine = ForcedCalls(server, tokenizer, [hermes_call("crop", x=8), "Now the colour. " +
                                                 hermes_call("swatch", color="teal")])
        loop = loop_of(engine, tokenizer, processor, [crop, swatch], max_assistant_turns=3)
        out = await loop.run({**SAMPLING, "max_tokens": 24}, raw_prompt=user_with(image_url_block(scene)),
                             request_id="vlm")
    finally:
        await server.close()

    assert not out.failed, out.metrics
    # The images, in token order: the prompt's, then each tool's.
    expected = [image_digest(scene), image_digest(crop_image), image_digest(swatch_image)]
    assert [item.digest for item in out.multi_modal_data["image"]] == expected
    assert [len(images) for _, images, _ in engine.calls] == [1, 2, 3]  # every call had the images so far
    image_id = processor.image_token_id
    assert out.prompt_ids.count(image_id) == out.multi_modal_data["image"][0].num_tokens
    assert image_masks(out, image_id) == [0] * sum(item.num_tokens for item in out.multi_modal_data["image"][1:])
    # Images first, then the text, in each tool message.
    assert tool_contents(out) == [[{"type": "image", "image": expected[1]}, {"type": "text", "text": "cropped at 8"}],
                                  [{"type": "image", "image": expected[2]}, {"type": "text", "text": "a teal swatch"}]]
    # The mask-1 tokens are the forced calls and then exactly what the engine generated.
    generated = [t for _, _, o in engine.calls for t in o.token_ids]
    assert [t for t, m in zip(out.response_ids, out.response_mask, strict=True) if m] == generated
    last_prompt, _, last = engine.calls[-1]
    assert out.prompt_ids + out.response_ids == last_prompt + list(last.token_ids)
    assert (out.metrics["tool_images"], out.metrics["tool_images_refused"]) == (2, 0)
    assert out.metrics.get("tokenization_mismatch", 0) == 0  # the strict check ran and passed
    assert out.metrics["assistant_turns"] == 3


async def test_each_segment_keeps_its_own_images_in_order(vlm):
    _, tokenizer, processor = vlm
    scene, first, second = picture((32, 32), seed=1), picture((32, 32), seed=2), picture((32, 32), seed=3)
    tool = Returns("snap", ToolResponse(text="one", image=[first]), ToolResponse(text="two", image=[second]))
    server = VisionScripted(tokenizer, [hermes_call("snap"), hermes_call("snap"), "done"], processor.image_token_id)
    # The trimming graph shows the model only the first and the last message: each tool result
    # starts a new segment whose prompt is the user's image and that result.
    outs = await loop_of(server, tokenizer, processor, [tool], graph_factory=TRIMMING).run(
        SAMPLING, raw_prompt=user_with(image_url_block(scene)))

    assert isinstance(outs, list)
    assert len(outs) == 3
    digests = [[item.digest for item in o.multi_modal_data["image"]] for o in outs]
    assert digests == [[image_digest(scene)], [image_digest(scene), image_digest(first)],
                       [image_digest(scene), image_digest(second)]]
    assert [len(images) for images in server.images] == [1, 2, 2]
    for o in outs:
        assert o.prompt_ids.count(processor.image_token_id) == sum(i.num_tokens for i in o.multi_modal_data["image"])
        assert o.metrics.get("tokenization_mismatch", 0) == 0
    assert outs[0].metrics["tool_images"] == 2


@pytest.mark.parametrize("block", [
    pytest.param(lambda img: image_url_block(img), id="image_url"),
    pytest.param(lambda img: {"type": "image", "base64": b64png(img), "mime_type": "image/png"}, id="v1-base64"),
    pytest.param(lambda img: {"type": "image", "source_type": "base64", "data": b64png(img),
                              "mime_type": "image/png"}, id="v0-base64"),
])
async def test_langchain_image_blocks_in_the_prompt(vlm, block):
    _, tokenizer, processor = vlm
    scene = picture((40, 40), seed=4)
    server = VisionScripted(tokenizer, ["done"], processor.image_token_id)
    out = await loop_of(server, tokenizer, processor, []).run(SAMPLING, raw_prompt=user_with(block(scene)))

    assert [item.digest for item in out.multi_modal_data["image"]] == [image_digest(scene)]
    assert [len(images) for images in server.images] == [1]
    assert out.extra_fields["messages"][0]["content"][0] == {"type": "image", "image": image_digest(scene)}


async def test_verl_rows_with_image_markers_and_an_images_column(vlm):
    _, tokenizer, processor = vlm
    first, second = picture((32, 32), seed=1), picture((40, 40), seed=2)
    server = VisionScripted(tokenizer, ["done"], processor.image_token_id)
    out = await loop_of(server, tokenizer, processor, []).run(
        SAMPLING, raw_prompt=[{"role": "user", "content": "<image>Compare it with <image>."}],
        images=[{"bytes": base64.b64decode(b64png(first))}, base64.b64decode(b64png(second))])

    assert [item.digest for item in out.multi_modal_data["image"]] == [image_digest(first), image_digest(second)]
    assert [len(images) for images in server.images] == [2]


@pytest.mark.parametrize(("block", "kind"), [
    ({"type": "video", "base64": "AAAA", "mime_type": "video/mp4"}, "video"),
    ({"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}}, "video"),
    ({"type": "audio", "base64": "AAAA", "mime_type": "audio/wav"}, "audio"),
    ({"type": "file", "base64": "AAAA", "mime_type": "application/pdf"}, "file"),
])
async def test_video_audio_and_file_blocks_are_refused_naming_what_is_supported(vlm, block, kind):
    _, tokenizer, processor = vlm
    server = VisionScripted(tokenizer, ["done"], processor.image_token_id)
    with pytest.raises(ValueError, match=f"{kind} is not supported") as info:
        await loop_of(server, tokenizer, processor, []).run(SAMPLING, raw_prompt=user_with(block))
    assert "'type': 'image_url'" in str(info.value)
    assert "'base64'" in str(info.value)
    assert server.images == []  # nothing was generated


async def test_tool_videos_and_over_limit_images_become_error_text(vlm):
    _, tokenizer, processor = vlm
    keep, extra = picture((32, 32), seed=6), picture((32, 32), seed=7)
    tool = Returns("film", ToolResponse(text="a clip", image=[keep, extra], video=[b"frames"]))
    server = VisionScripted(tokenizer, [hermes_call("film"), "done"], processor.image_token_id)
    out = await loop_of(server, tokenizer, processor, [tool], max_images=2).run(
        SAMPLING, raw_prompt=user_with(image_url_block(picture())))

    (content,) = tool_contents(out)
    assert content[0] == {"type": "image", "image": image_digest(keep)}
    text = content[1]["text"]
    assert text.startswith("a clip\n")
    assert f"Error: tool 'film' returned 1 video(s); {VIDEO_REFUSAL}." in text
    assert "more than 2 images in one trajectory (max_images)" in text
    assert (out.metrics["tool_images"], out.metrics["tool_images_refused"], out.metrics["tool_videos_refused"]) == (1, 1, 1)
    assert len(out.multi_modal_data["image"]) == 2
    assert out.metrics["assistant_turns"] == 2  # the trajectory went on


async def test_parallel_calls_count_against_max_images_together(vlm):
    _, tokenizer, processor = vlm
    tool = Returns("snap", ToolResponse(text="one", image=[picture((32, 32), seed=8)]),
                   ToolResponse(text="two", image=[picture((32, 32), seed=9)]))
    server = VisionScripted(tokenizer, [hermes_call("snap") + "\n" + hermes_call("snap"), "done"],
                            processor.image_token_id)
    out = await loop_of(server, tokenizer, processor, [tool], max_images=1).run(
        SAMPLING, raw_prompt=[{"role": "user", "content": "Take two pictures."}])

    assert not out.failed, out.metrics
    assert len(out.multi_modal_data["image"]) == 1
    assert (out.metrics["tool_images"], out.metrics["tool_images_refused"]) == (1, 1)
    assert sum("max_images" in str(c) for c in tool_contents(out)) == 1


async def test_an_image_the_processor_refuses_is_replaced_by_error_text(vlm):
    _, tokenizer, processor = vlm
    sliver = Image.new("RGB", (2000, 5))  # within every limit, but Qwen-VL refuses an aspect ratio over 200
    server = VisionScripted(tokenizer, [hermes_call("snap"), "done"], processor.image_token_id)
    out = await loop_of(server, tokenizer, processor, [Returns("snap", ToolResponse(text="thin", image=[sliver]))]).run(
        SAMPLING, raw_prompt=[{"role": "user", "content": "Look."}])

    (content,) = tool_contents(out)
    assert content.startswith("Error: an image was not shown (")
    assert content.endswith(").\nthin")
    assert "aspect ratio must be smaller than 200" in content
    assert (out.metrics["tool_images"], out.metrics["tool_images_refused"]) == (0, 1)
    assert out.metrics["assistant_turns"] == 2
    assert out.multi_modal_data is None


async def test_tool_images_for_a_text_only_model_are_error_text_naming_the_fix():
    tokenizer = load_tiny_tokenizer()
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    # A text-only engine: its generate takes no multi_modal_data, so passing any would fail here.
    replies = [hermes_call("snap"), "done"]
    server = ScriptedServer(lambda r, p, i: tokenizer.encode(replies[min(i, 1)], add_special_tokens=False),
                            eos_token_id=eos, append_eos=True)
    tool = Returns("snap", ToolResponse(text="here", image=[picture((32, 32)), picture((32, 32), seed=3)]))
    out = await ReactAgentLoop(server, tokenizer, {"tools": {"snap": tool}, "sanity_check": "strict"}).run(
        SAMPLING, raw_prompt=[{"role": "user", "content": "Take a picture."}])

    assert not out.failed, out.metrics
    (content,) = tool_contents(out)
    assert content == f"here\nError: tool 'snap' returned 2 image(s), but {NO_VISION_FIX}."
    assert (out.metrics["tool_images_refused"], out.metrics["tool_images_no_vision"]) == (2, 2)
    assert out.metrics["assistant_turns"] == 2
    assert out.multi_modal_data is None


async def test_a_prompt_image_for_a_text_only_model_is_a_value_error_naming_the_fix():
    tokenizer = load_tiny_tokenizer()
    server = ScriptedServer([tokenizer.encode("done", add_special_tokens=False)],
                            eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"), append_eos=True)
    loop = ReactAgentLoop(server, tokenizer, {"tools": {}})
    with pytest.raises(ValueError, match="text-only model; use a vision-language model"):
        await loop.run(SAMPLING, raw_prompt=user_with(image_url_block(picture())))
    assert server.calls == []


def test_content_parts_reads_each_langchain_form_and_keeps_text_only_content_a_string():
    data = b64png(picture((8, 8)))
    forms = [{"type": "image_url", "image_url": {"url": "data:image/png;base64," + data}},
             {"type": "image_url", "image_url": "data:image/png;base64," + data},
             {"type": "image", "base64": data, "mime_type": "image/png"},
             {"type": "image", "source_type": "base64", "data": data, "mime_type": "image/png"}]
    for form in forms:
        parts = content_parts(ToolMessage(content=["a", form, {"type": "text", "text": "b"}], tool_call_id="1"))
        assert parts == [{"type": "text", "text": "a"}, {"type": "image", "image": "data:image/png;base64," + data},
                         {"type": "text", "text": "b"}]
    assert content_parts(HumanMessage(content=["a", {"type": "text", "text": "b"}])) == "ab"
    with pytest.raises(ValueError, match="provider file id"):
        content_parts(HumanMessage(content=[{"type": "image", "file_id": "file-1"}]))


async def test_a_tool_image_is_processed_once(vlm):
    """The tool adapter processes an image to screen it; the trajectory then takes that item
    with the message's PNG block instead of decoding and processing the PNG again."""
    _, tokenizer, processor = vlm
    seen: list[str] = []
    real_process = processor.process

    def counting(image):
        item = real_process(image)
        seen.append(item.digest)
        return item

    first, second = picture((32, 32), seed=11), picture((40, 32), seed=12)
    tool = Returns("snap", ToolResponse(text="one", image=[first]), ToolResponse(text="two", image=[second]))
    server = VisionScripted(tokenizer, [hermes_call("snap"), hermes_call("snap"), "done"], processor.image_token_id)
    processor.process = counting
    try:
        out = await loop_of(server, tokenizer, processor, [tool]).run(
            SAMPLING, raw_prompt=[{"role": "user", "content": "Take two pictures."}])
    finally:
        del processor.process
    assert not out.failed, out.metrics
    assert [item.digest for item in out.multi_modal_data["image"]] == [image_digest(first), image_digest(second)]
    assert seen == [image_digest(first), image_digest(second)]
    assert out.metrics.get("tokenization_mismatch", 0) == 0
