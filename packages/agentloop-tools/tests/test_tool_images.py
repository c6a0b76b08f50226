"""Tools that return images, below the loop: ``@function_tool`` return values, the built-in
``image_zoom_in`` tool, MCP image results and the loop's image settings. The loop itself (on
the tiny vision-language model) is in test_tool_images_loop.py."""

from __future__ import annotations

import base64
import io
import json

import pytest

Image = pytest.importorskip("PIL.Image", reason="images need Pillow")

from agentloop_core.vision import image_digest  # noqa: E402
from agentloop_tools.builtin import ImageZoomInTool  # noqa: E402
from agentloop_tools.builtin.image_zoom import MIN_SIDE, crop_box  # noqa: E402
from agentloop_tools.function_tool import function_tool, normalize_tool_result  # noqa: E402
from agentloop_tools.load_tools import load_tools  # noqa: E402
from agentloop_tools.loop_config import ToolAgentConfig  # noqa: E402
from agentloop_tools.schema import ToolResponse  # noqa: E402


def quadrants(size=(100, 60)) -> Image.Image:
    """Red top-left, green top-right, blue bottom-left, white bottom-right."""
    w, h = size
    image = Image.new("RGB", size, (255, 255, 255))
    image.paste((255, 0, 0), (0, 0, w // 2, h // 2))
    image.paste((0, 255, 0), (w // 2, 0, w, h // 2))
    image.paste((0, 0, 255), (0, h // 2, w // 2, h))
    return image


def png(image: Image.Image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, "PNG")
    return buf.getvalue()


# --- @function_tool ---------------------------------------------------------------------------

RED, BLUE = Image.new("RGB", (8, 8), (255, 0, 0)), Image.new("RGB", (8, 8), (0, 0, 255))


@pytest.mark.parametrize(("returned", "text", "images"), [
    (RED, None, [RED]),
    ([RED, BLUE], None, [RED, BLUE]),
    (("two squares", [RED, BLUE]), "two squares", [RED, BLUE]),
    (("a square", RED), "a square", [RED]),
    (ToolResponse(text="t", image=[BLUE]), "t", [BLUE]),
])
def test_function_tool_image_returns_become_image_responses(returned, text, images):
    response, reward, metrics = normalize_tool_result(returned, tool_name="draw")
    assert (response.text, reward, metrics) == (text, 0.0, {})
    assert response.image == images
    assert all(a is b for a, b in zip(response.image, images, strict=True))


def test_function_tool_image_pair_with_a_reward_and_metrics():
    response, reward, metrics = normalize_tool_result((("a square", RED), 0.5, {"n": 1}), tool_name="draw")
    assert (response.text, response.image, reward, metrics) == ("a square", [RED], 0.5, {"n": 1})
    # A plain (response, reward) pair is still read as one.
    response, reward, _ = normalize_tool_result((RED, 1), tool_name="draw")
    assert (response.image, reward) == ([RED], 1.0)
    # An empty list stays JSON text, as before.
    assert normalize_tool_result([], tool_name="draw")[0] == ToolResponse(text="[]")


@pytest.mark.parametrize(("returned", "message"), [
    ([RED, "caption"], "a list mixing images with other values; return a list of PIL images only"),
    ((3, RED), r"returned \(int, image\); the first item of a \(text, image\) pair must be a str"),
    (object(), "return str, dict, list, a PIL image"),
])
def test_function_tool_bad_image_returns_name_the_fix(returned, message):
    with pytest.raises(TypeError, match=message):
        normalize_tool_result(returned, tool_name="draw")


async def test_function_tool_returning_an_image_through_execute():
    @function_tool
    def draw(color: str):
        """Draw a square.

        Args:
            color: red or blue.
        """
        return f"a {color} square", RED if color == "red" else BLUE

    iid = await draw.create()
    response, _, _ = await draw.execute(iid, {"color": "blue"})
    assert (response.text, response.image) == ("a blue square", [BLUE])


# --- image_zoom_in ------------------------------------------------------------------------------

@pytest.mark.parametrize("source", [
    quadrants(), png(quadrants()), {"bytes": png(quadrants())},
    "data:image/png;base64," + base64.b64encode(png(quadrants())).decode(),
])
async def test_zoom_crops_the_row_image_in_original_pixels(source):
    tool = ImageZoomInTool()
    assert tool.name == "image_zoom_in"
    iid = await tool.create(create_kwargs={"image": source})
    response, reward, metrics = await tool.execute(iid, {"bbox_2d": [50, 0, 100, 30], "label": "green"})
    (crop,) = response.image
    assert crop.size == (50, 30)
    assert [c for _, c in crop.getcolors()] == [(0, 255, 0)]  # exactly the green quadrant
    assert image_digest(crop) == image_digest(quadrants().crop((50, 0, 100, 30)))
    assert response.text == "Zoomed in on [50, 0, 100, 30] (green): 50x30 pixels, shown at 50x30."
    assert (reward, metrics) == (0.0, {"success": 1})
    await tool.release(iid)


async def test_zoom_enlarges_a_small_crop_to_the_minimum_side():
    tool = ImageZoomInTool()
    iid = await tool.create(create_kwargs={"image": quadrants()})
    response, _, _ = await tool.execute(iid, {"bbox_2d": [0.4, 50, 20, 60]})  # 20x10, floats rounded
    (crop,) = response.image
    assert min(crop.size) == MIN_SIDE
    assert crop.size == (56, 28)
    assert response.text.endswith("20x10 pixels, shown at 56x28.")
    assert [c for _, c in crop.getcolors()] == [(0, 0, 255)]


@pytest.mark.parametrize(("bbox", "message"), [
    ([10, 10, 20], "bbox_2d must be 4 numbers [x1, y1, x2, y2], got 3 values"),
    ("0,0,5,5", "bbox_2d must be 4 numbers [x1, y1, x2, y2], got str"),
    (None, "got NoneType"),
    ([0, 0, "5", 5], "bbox_2d must be 4 numbers [x1, y1, x2, y2], got [0, 0, '5', 5]"),
    ([0, 0, True, 5], "got [0, 0, True, 5]"),
    ([20, 10, 20, 30], "bbox_2d [20, 10, 20, 30] is empty: it needs x2 > x1 and y2 > y1"),
    ([30, 10, 20, 30], "is empty"),
    ([0, 0, 101, 60], "bbox_2d [0, 0, 101, 60] is outside the image, which is 100x60 pixels (x in 0..100, y in 0..60)"),
    ([-1, 0, 10, 10], "is outside the image"),
])
async def test_zoom_errors_are_text_for_the_model(bbox, message):
    tool = ImageZoomInTool()
    iid = await tool.create(create_kwargs={"image": quadrants()})
    response, reward, metrics = await tool.execute(iid, {"bbox_2d": bbox})
    assert response.image is None
    assert response.text.startswith("Error: ")
    assert message in response.text
    assert (reward, metrics) == (0.0, {"success": 0})


def test_crop_box_refuses_a_sliver_qwen_vl_could_not_read():
    assert crop_box([0, 0, 200, 2], (300, 60)) == (0, 0, 200, 2)  # 100:1 is the most allowed
    with pytest.raises(ValueError, match=r"bbox_2d \[0, 0, 202, 2\] is 202x2 pixels, more elongated than 100:1"):
        crop_box([0, 0, 202, 2], (300, 60))


def test_crop_box_accepts_the_whole_image():
    assert crop_box([0, 0, 100, 60], (100, 60)) == (0, 0, 100, 60)
    assert crop_box((0.6, 0.4, 99.5, 59.6), (100, 60)) == (1, 0, 100, 60)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({}, r"needs the row's image: set tools_kwargs\['image_zoom_in'\]\['create_kwargs'\]\['image'\]"),
    ({"image": [png(quadrants()), png(quadrants())]}, "is a list of 2; pass the one image"),
    ({"image": b"junk"}, "not a readable image"),
    ({"image": png(quadrants()), "mask": 1}, r"unexpected create kwargs \['mask'\]"),
])
async def test_zoom_create_errors_name_the_row_key(kwargs, message):
    with pytest.raises(ValueError, match=message):
        await ImageZoomInTool().create(create_kwargs=kwargs)


async def test_zoom_row_image_over_the_pixel_limit_is_refused():
    tool = ImageZoomInTool({"max_pixels": 5000})
    with pytest.raises(ValueError, match=r"100x60 = 6000 pixels is over the limit of 5000"):
        await tool.create(create_kwargs={"image": png(quadrants())})
    with pytest.raises(ValueError, match="config max_bytes must be a positive integer"):
        ImageZoomInTool({"max_bytes": 0})


def test_zoom_loads_from_a_tool_config(tmp_path):
    (tmp_path / "tools.yaml").write_text(
        "tools:\n  - class_name: agentloop_tools.builtin.image_zoom.ImageZoomInTool\n"
        "    config: {type: native, timeout_s: 5, max_pixels: 1000000}\n")
    tools = load_tools(tmp_path / "tools.yaml")
    assert list(tools) == ["image_zoom_in"]
    assert tools["image_zoom_in"].limits.max_pixels == 1_000_000
    params = tools["image_zoom_in"].tool_schema.function.parameters
    assert params.required == ["bbox_2d"]
    assert set(params.properties) == {"bbox_2d", "label"}


# --- loop settings ------------------------------------------------------------------------------

def test_image_limits_are_loop_settings():
    cfg = ToolAgentConfig.from_mapping({"max_images": 3, "max_image_pixels": 4096, "max_image_bytes": 1000})
    assert (cfg.max_images, cfg.max_image_pixels, cfg.max_image_bytes) == (3, 4096, 1000)
    default = ToolAgentConfig()
    assert (default.max_images, default.max_image_pixels, default.max_image_bytes) == (32, 16_777_216, 20 * 2**20)
    for key in ("max_images", "max_image_pixels", "max_image_bytes"):
        with pytest.raises(ValueError, match=f"tool_agent config {key} must be a positive integer, got 0"):
            ToolAgentConfig.from_mapping({key: 0})


# --- MCP ----------------------------------------------------------------------------------------

async def test_mcp_image_results_reach_the_loop_as_images(monkeypatch):
    fastmcp = pytest.importorskip("fastmcp", reason='MCP tests need fastmcp: pip install "agentloop-tools[mcp]"')
    from fastmcp.utilities.types import Image as MCPImage

    from agentloop_tools.mcp import MCPTool, MCPToolset, parse_mcp_servers

    server = fastmcp.FastMCP("images")

    @server.tool
    def snapshot(broken: bool = False) -> list:
        """A picture of the scene."""
        return ["the scene", MCPImage(data=b"\x89PNG\r\n\x1a\n broken" if broken else png(quadrants()), format="png")]

    (config,) = parse_mcp_servers({"mcpServers": {"mem": {"url": "http://127.0.0.1:9/mcp"}}})
    toolset = MCPToolset(config)
    monkeypatch.setattr(toolset, "_make_client", lambda: fastmcp.Client(server))  # in memory, no socket
    (schema,) = await toolset.list_tools()
    tool = MCPTool({}, schema, toolset)
    iid = await tool.create()
    response, _, metrics = await tool.execute(iid, {})
    assert response.text == "the scene"
    assert not metrics["mcp_is_error"]
    (image,) = response.image
    assert image_digest(image.convert("RGB")) == image_digest(quadrants())
    # Bytes PIL cannot open are passed on as bytes, for the loop to refuse with the reason.
    response, _, _ = await tool.execute(iid, {"broken": True})
    assert response.image == [b"\x89PNG\r\n\x1a\n broken"]
    await toolset.aclose()
    assert json.loads(json.dumps(schema.model_dump()))["function"]["name"] == "snapshot"
