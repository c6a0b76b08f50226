"""Tools that return images, in ``tool_agent`` and ``env_agent`` on the tiny vision-language model.

The end-to-end test runs the real engine (HFServer serving the tiny random Qwen2-VL): every
prompt, with its images, goes to it, and it checks each image's tokens against the image's
features. A random model never writes a tool call, so the calls of the first turns are forced
(see :class:`ForcedCalls`); the last turn is the engine's own. The other tests check loop logic
on a scripted engine with the tiny VLM's real tokenizer, chat template and image processor.
"""

from __future__ import annotations

import io
import json
from typing import Any

import pytest

pytest.importorskip("torch", reason="the tiny VLM needs torch (pip install \"agentloop-engines[hf]\")")
tiny_vlm = pytest.importorskip("agentloop_engines.testing.tiny_vlm", reason="agentloop-engines is not installed")

from PIL import Image  # noqa: E402

from agentloop_core.environment import AssistantTurn, Environment, StepResult, register_environment  # noqa: E402
from agentloop_core.testing import ScriptedServer, load_tiny_tokenizer  # noqa: E402
from agentloop_core.testing.vision_engines import ForcedTurns as ForcedCalls  # noqa: E402
from agentloop_core.testing.vision_engines import VisionScriptedServer as VisionScripted  # noqa: E402
from agentloop_core.testing.vision_engines import gradient_picture as picture  # noqa: E402
from agentloop_core.vision import image_digest, load_vision_processor  # noqa: E402
from agentloop_tools.agent_loop import ToolAgentLoop  # noqa: E402
from agentloop_tools.base import BaseTool  # noqa: E402
from agentloop_tools.builtin import ImageZoomInTool  # noqa: E402
from agentloop_tools.env_agent import EnvAgentLoop  # noqa: E402
from agentloop_tools.function_tool import function_tool  # noqa: E402
from agentloop_tools.schema import ToolResponse  # noqa: E402
from agentloop_tools.tool_media import VIDEO_REFUSAL  # noqa: E402
from agentloop_tools.truncation import truncate_text  # noqa: E402

SAMPLING = {"temperature": 0.0, "logprobs": True}


@pytest.fixture(scope="module")
def vlm():
    """``(folder, tokenizer, processor)`` of the tiny VLM."""
    import transformers

    folder = tiny_vlm.build_tiny_vlm()
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(folder))
    return folder, tokenizer, load_vision_processor(folder, tokenizer)


def png(image: Image.Image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, "PNG")
    return buf.getvalue()


def call(name: str, **arguments: Any) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


def prompt_with(image: Image.Image, text: str = "What is in the picture?") -> list[dict[str, Any]]:
    return [{"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": text}]}]


class Returns(BaseTool):
    """Returns the given ToolResponse on every call."""

    def __init__(self, name: str, response: ToolResponse) -> None:
        super().__init__({}, {"type": "function", "function": {"name": name, "description": f"the {name} tool",
                                                               "parameters": {"type": "object", "properties": {}}}})
        self.response = response

    async def execute(self, instance_id, parameters):
        return self.response, 0.0, {}


def tool_contents(out) -> list[Any]:
    return [m["content"] for m in out.extra_fields["messages"] if m["role"] == "tool"]


def loop_of(server, tokenizer, processor, tools, **config) -> ToolAgentLoop:
    config.setdefault("response_length", 4096)
    return ToolAgentLoop(server, tokenizer, {"tools": {t.name: t for t in tools}, "sanity_check": "strict", **config},
                         processor=processor)


async def test_images_from_two_tools_on_the_real_engine_pass_the_strict_check(vlm):
    from agentloop_engines.adapters.hf import HFServer

    folder, tokenizer, processor = vlm
    scene = picture((64, 48))
    swatch_image = picture((40, 30), seed=99)

    @function_tool
    def swatch(color: str):
        """Show a colour swatch.

        Args:
            color: The colour's name.
        """
        return f"a {color} swatch", swatch_image

    server = HFServer(folder, seed=0)
    try:
        engine = ForcedCalls(server, tokenizer, [call("image_zoom_in", bbox_2d=[8, 8, 40, 40], label="corner"),
                                                 "Now the colour. " + call("swatch", color="teal")])
        loop = loop_of(engine, tokenizer, processor, [ImageZoomInTool(), swatch], max_assistant_turns=3)
        out = await loop.run({**SAMPLING, "max_tokens": 24}, raw_prompt=prompt_with(scene), request_id="vlm",
                             tools_kwargs={"image_zoom_in": {"create_kwargs": {"image": png(scene)}}})
    finally:
        await server.close()

    # The images, in token order: the prompt's, the zoom's crop, the swatch.
    expected = [image_digest(scene), image_digest(scene.crop((8, 8, 40, 40))), image_digest(swatch_image)]
    assert [item.digest for item in out.multi_modal_data["image"]] == expected
    assert [len(images) for _, images, _ in engine.calls] == [1, 2, 3]  # every call had the images so far
    tool_images = out.multi_modal_data["image"][1:]
    image_id = processor.image_token_id
    in_response = [m for t, m in zip(out.response_ids, out.response_mask, strict=True) if t == image_id]
    assert in_response == [0] * sum(item.num_tokens for item in tool_images)
    assert out.prompt_ids.count(image_id) == out.multi_modal_data["image"][0].num_tokens
    # Images first, then the text, in each tool message.
    zoom, colour = tool_contents(out)
    assert [p["type"] for p in zoom] == ["image", "text"]
    assert zoom[0]["image"] == expected[1]
    assert zoom[1]["text"].startswith("Zoomed in on [8, 8, 40, 40] (corner)")
    assert colour == [{"type": "image", "image": expected[2]}, {"type": "text", "text": "a teal swatch"}]
    # The mask-1 tokens are the forced calls and then exactly what the engine generated.
    generated = [t for _, _, o in engine.calls for t in o.token_ids]
    assert [t for t, m in zip(out.response_ids, out.response_mask, strict=True) if m] == generated
    last_prompt, _, last = engine.calls[-1]
    assert out.prompt_ids + out.response_ids == last_prompt + list(last.token_ids)
    assert out.metrics["tool_images"] == 2
    assert out.metrics["tool_images_refused"] == 0
    assert out.metrics.get("tokenization_mismatch", 0) == 0
    assert out.metrics["assistant_turns"] == 3


async def test_refused_images_become_error_text_and_the_trajectory_goes_on(vlm, tmp_path):
    _, tokenizer, processor = vlm
    good = picture((32, 32), seed=5)
    bomb = png(Image.new("L", (6000, 6000)))  # a few kB that declare 36 M pixels
    truncated = png(picture((64, 64)))[:200]  # a readable header, then the data stops
    (tmp_path / "good.png").write_bytes(png(good))  # a tool's result may echo a path the model chose
    tool = Returns("snap", ToolResponse(text="three pictures", image=[bomb, good, truncated, b"not an image",
                                                                       str(tmp_path / "good.png")]))
    server = VisionScripted(tokenizer, [call("snap"), "done"], processor.image_token_id)
    out = await loop_of(server, tokenizer, processor, [tool], max_image_pixels=1_000_000).run(
        SAMPLING, raw_prompt=[{"role": "user", "content": "Take a picture."}])

    (content,) = tool_contents(out)
    assert content[0] == {"type": "image", "image": image_digest(good)}
    text = content[1]["text"]
    assert text.startswith("three pictures\n")
    assert "6000x6000 = 36000000 pixels is over the limit of 1000000" in text
    assert "tool 'snap' result image 2: the image data is corrupt" in text
    assert "tool 'snap' result image 3: not a readable image" in text
    assert "tool 'snap' result image 4: a file path is not accepted here" in text
    assert out.metrics["tool_images"] == 1
    assert out.metrics["tool_images_refused"] == 4
    assert out.metrics["assistant_turns"] == 2  # the trajectory went on after the refusals
    assert [len(images) for images in server.images] == [0, 1]
    assert [item.digest for item in out.multi_modal_data["image"]] == [image_digest(good)]


async def test_max_images_counts_the_prompt_and_refuses_the_rest(vlm):
    _, tokenizer, processor = vlm
    first, second = picture((32, 32), seed=1), picture((32, 32), seed=2)
    tool = Returns("snap", ToolResponse(image=[first, second]))
    server = VisionScripted(tokenizer, [call("snap"), "done"], processor.image_token_id)
    out = await loop_of(server, tokenizer, processor, [tool], max_images=2).run(
        SAMPLING, raw_prompt=prompt_with(picture()))

    (content,) = tool_contents(out)
    assert content[0] == {"type": "image", "image": image_digest(first)}
    assert "more than 2 images in one trajectory (max_images)" in content[1]["text"]
    assert len(out.multi_modal_data["image"]) == 2
    assert (out.metrics["tool_images"], out.metrics["tool_images_refused"]) == (1, 1)


async def test_truncation_cuts_the_text_and_keeps_the_image(vlm):
    _, tokenizer, processor = vlm
    long = "".join(str(i % 10) for i in range(300))
    image = picture((32, 32))
    server = VisionScripted(tokenizer, [call("snap"), "done"], processor.image_token_id)
    loop = loop_of(server, tokenizer, processor, [Returns("snap", ToolResponse(text=long, image=[image]))],
                   max_tool_response_length=20)
    out = await loop.run(SAMPLING, raw_prompt=[{"role": "user", "content": "Look."}])

    assert tool_contents(out) == [[{"type": "image", "image": image_digest(image)},
                                   {"type": "text", "text": truncate_text(long, 20, "middle")}]]
    assert out.metrics["tool_responses_truncated_length"] == 1
    assert out.metrics["tool_images"] == 1


async def test_videos_are_refused_with_what_is_supported(vlm):
    _, tokenizer, processor = vlm
    server = VisionScripted(tokenizer, [call("film"), "done"], processor.image_token_id)
    loop = loop_of(server, tokenizer, processor, [Returns("film", ToolResponse(text="a clip", video=[b"frames"]))])
    out = await loop.run(SAMPLING, raw_prompt=[{"role": "user", "content": "Film it."}])

    (content,) = tool_contents(out)
    assert content == f"a clip\nError: tool 'film' returned 1 video(s); {VIDEO_REFUSAL}."
    assert out.metrics["tool_videos_refused"] == 1
    assert out.multi_modal_data is None


async def test_text_only_model_gets_error_text_naming_the_fix():
    tokenizer = load_tiny_tokenizer()
    # A text-only engine: its generate takes no multi_modal_data, so passing any would fail here.
    server = ScriptedServer(lambda r, p, i: tokenizer.encode([call("snap"), "done"][min(i, 1)], add_special_tokens=False),
                            eos_token_id=tokenizer.eos_token_id, append_eos=True)
    tool = Returns("snap", ToolResponse(text="here", image=[picture((32, 32)), picture((32, 32), seed=3)]))
    loop = ToolAgentLoop(server, tokenizer, {"tools": {"snap": tool}, "sanity_check": "strict"})
    out = await loop.run(SAMPLING, raw_prompt=[{"role": "user", "content": "Take a picture."}])

    (content,) = tool_contents(out)
    assert content.startswith("here\nError: tool 'snap' returned 2 image(s), but this model reads text only")
    assert "serve a vision-language model" in content
    assert (out.metrics["tool_images_refused"], out.metrics["tool_images_no_vision"]) == (2, 2)
    assert out.metrics["assistant_turns"] == 2
    assert out.multi_modal_data is None


async def test_an_image_the_processor_refuses_is_replaced_by_error_text(vlm):
    _, tokenizer, processor = vlm
    sliver = Image.new("RGB", (2000, 5))  # within every limit, but Qwen-VL refuses an aspect ratio over 200
    server = VisionScripted(tokenizer, [call("snap"), "done"], processor.image_token_id)
    out = await loop_of(server, tokenizer, processor, [Returns("snap", ToolResponse(text="thin", image=[sliver]))]).run(
        SAMPLING, raw_prompt=[{"role": "user", "content": "Look."}])

    (content,) = tool_contents(out)
    assert content[1] == {"type": "text", "text": "thin"}
    assert content[0]["type"] == "text"
    assert "aspect ratio must be smaller than 200" in content[0]["text"]
    assert (out.metrics["tool_images"], out.metrics["tool_images_refused"]) == (0, 1)
    assert out.metrics["assistant_turns"] == 2
    assert out.multi_modal_data is None


async def test_verl_rows_with_image_markers_and_an_images_column(vlm):
    _, tokenizer, processor = vlm
    first, second = picture((32, 32), seed=1), picture((40, 40), seed=2)
    server = VisionScripted(tokenizer, ["done"], processor.image_token_id)
    out = await loop_of(server, tokenizer, processor, []).run(
        SAMPLING, raw_prompt=[{"role": "user", "content": "<image>Compare it with <image>."}],
        images=[{"bytes": png(first)}, png(second)])

    assert [item.digest for item in out.multi_modal_data["image"]] == [image_digest(first), image_digest(second)]
    assert out.extra_fields["messages"][0]["content"] == [
        {"type": "image", "image": image_digest(first)}, {"type": "text", "text": "Compare it with "},
        {"type": "image", "image": image_digest(second)}, {"type": "text", "text": "."}]
    assert [len(images) for images in server.images] == [2]


def test_processor_must_be_a_vision_processor(vlm):
    _, tokenizer, _ = vlm
    with pytest.raises(TypeError, match="load_vision_processor"):
        ToolAgentLoop(VisionScripted(tokenizer, ["x"], 0), tokenizer, {}, processor=object())


SCENE = picture((48, 48), seed=7)


@register_environment("test_vision_env")
class LookEnv(Environment):
    """Shows an image after the first turn, then sends a video and a bomb, then ends."""

    async def step(self, turn: AssistantTurn) -> StepResult:
        if turn.index == 0:
            return StepResult([{"role": "user", "content": [
                {"type": "text", "text": "Here it is: " + "x" * 50}, {"type": "image", "image": png(SCENE)}]}],
                0.0, False, {})
        if turn.index == 1:
            return StepResult([{"role": "user", "content": [
                {"type": "video", "video": b"frames"}, {"type": "image", "image": png(Image.new("L", (6000, 6000)))},
                {"type": "text", "text": "and?"}]}], 0.0, False, {})
        return StepResult([], 1.0, True, {})


async def test_environment_images_enter_the_conversation(vlm):
    _, tokenizer, processor = vlm
    server = VisionScripted(tokenizer, ["show me", "more", "ok"], processor.image_token_id)
    loop = EnvAgentLoop(server, tokenizer, {"environment": "test_vision_env", "sanity_check": "strict",
                                            "max_tool_response_length": 20, "response_length": 1024},
                        processor=processor)
    out = await loop.run(SAMPLING, raw_prompt=[{"role": "user", "content": "Look."}])

    shown, refused = [m["content"] for m in out.extra_fields["messages"][2::2]]
    assert shown == [{"type": "text", "text": truncate_text("Here it is: " + "x" * 50, 20, "middle")},
                     {"type": "image", "image": image_digest(SCENE)}]
    assert refused[0] == {"type": "text", "text": f"Error: environment 'test_vision_env' step 1 message 0, "
                                                  f"content[0] returned 1 video(s); {VIDEO_REFUSAL}."}
    assert "is over the limit of" in refused[1]["text"]
    assert refused[2] == {"type": "text", "text": "and?"}
    assert [item.digest for item in out.multi_modal_data["image"]] == [image_digest(SCENE)]
    assert [len(images) for images in server.images] == [0, 1, 1]
    assert (out.metrics["tool_images"], out.metrics["tool_images_refused"], out.metrics["tool_videos_refused"]) == (1, 1, 1)
    assert out.reward_score == 1.0


async def test_mcp_images_reach_the_conversation(vlm, monkeypatch):
    fastmcp = pytest.importorskip("fastmcp", reason='MCP tests need fastmcp: pip install "agentloop-tools[mcp]"')
    from fastmcp.utilities.types import Image as MCPImage

    from agentloop_tools.mcp import MCPTool, MCPToolset, parse_mcp_servers

    _, tokenizer, processor = vlm
    scene = picture((40, 40), seed=11)
    mcp = fastmcp.FastMCP("images")

    @mcp.tool
    def snapshot() -> list:
        """A picture of the scene, and a broken one."""
        return ["the scene", MCPImage(data=png(scene), format="png"), MCPImage(data=b"\x89PNG\r\n\x1a\nxx", format="png")]

    (config,) = parse_mcp_servers({"mcpServers": {"mem": {"url": "http://127.0.0.1:9/mcp"}}})
    toolset = MCPToolset(config)
    monkeypatch.setattr(toolset, "_make_client", lambda: fastmcp.Client(mcp))  # in memory, no socket
    (schema,) = await toolset.list_tools()
    server = VisionScripted(tokenizer, [call("snapshot"), "done"], processor.image_token_id)
    try:
        out = await loop_of(server, tokenizer, processor, [MCPTool({}, schema, toolset)]).run(
            SAMPLING, raw_prompt=[{"role": "user", "content": "Look."}])
    finally:
        await toolset.aclose()

    (content,) = tool_contents(out)
    assert content[0] == {"type": "image", "image": image_digest(scene)}
    assert content[1]["text"].startswith("the scene\nError: tool 'snapshot' result image 1: not a readable image")
    assert [item.digest for item in out.multi_modal_data["image"]] == [image_digest(scene)]
    assert [len(images) for images in server.images] == [0, 1]
    assert (out.metrics["tool_images"], out.metrics["tool_images_refused"]) == (1, 1)
