"""Images in trajectories: decoding with limits, content parts, and the delta method with images
(prompt and appended messages), checked against full renders of the conversation."""

from __future__ import annotations

import base64
import io

import pytest

from agentloop_core.protocol import TokenOutput
from agentloop_core.testing.vision_engines import bomb_png as _bomb_png
from agentloop_core.tokenization import ChatRenderer, Trajectory
from agentloop_core.tokenization.sanity import SanityCheckReport
from agentloop_core.vision import (
    ConversationImages,
    ImageError,
    ImageItem,
    ImageLimits,
    decode_image,
    images_of,
    messages_with_row_images,
    multi_modal_kwargs,
)

Image = pytest.importorskip("PIL.Image")
pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def tiny():
    from agentloop_core.testing.tiny_vision import tiny_vision_processor

    return tiny_vision_processor()


def _picture(w: int, h: int, seed: int = 0):
    import numpy as np

    return Image.fromarray((np.random.RandomState(seed).rand(h, w, 3) * 255).astype("uint8"))


def _png(image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def _data_url(image) -> str:
    return "data:image/png;base64," + base64.b64encode(_png(image)).decode()


# -- decoding -------------------------------------------------------------------------------


def test_every_source_form_decodes_to_the_same_rgb_pixels(tmp_path):
    picture = _picture(40, 30)
    path = tmp_path / "p.png"
    path.write_bytes(_png(picture))
    sources = [picture, _png(picture), _data_url(picture), str(path), f"file://{path}", path,
               {"bytes": _png(picture), "path": None}, {"path": str(path)}, {"url": _data_url(picture)}]
    for source in sources:
        image = decode_image(source)
        assert image.mode == "RGB"
        assert image.size == (40, 30)
        assert image.tobytes() == picture.tobytes(), type(source)


def test_palette_alpha_and_grey_images_become_rgb():
    for mode in ("P", "RGBA", "L", "LA"):
        image = decode_image(_png(Image.new(mode, (8, 8))))
        assert image.mode == "RGB"


@pytest.mark.parametrize("mode", ["RGBA", "LA", "P"])
def test_transparent_pixels_are_laid_on_white_as_the_vision_processors_do(mode):
    """Black line art on a transparent background: dropping alpha would show the model black."""
    import numpy as np
    from PIL import ImageDraw
    from transformers.image_transforms import convert_to_rgb

    art = Image.new("RGBA", (16, 16), (0, 0, 0, 0))
    ImageDraw.Draw(art).line([(0, 0), (15, 15)], fill=(0, 0, 0, 255), width=3)
    if mode == "LA":
        art = art.convert("LA")
    elif mode == "P":  # a palette with one transparent index
        art = art.convert("P")
        art.info["transparency"] = art.getpixel((15, 0))
    data = _png(art)
    ours = decode_image(data)
    assert ours.getpixel((15, 0)) == (255, 255, 255)  # transparent: white
    assert ours.getpixel((8, 8)) == (0, 0, 0)  # the line: black
    theirs = np.asarray(convert_to_rgb(Image.open(io.BytesIO(data))))
    assert np.array_equal(np.asarray(ours), theirs)


def test_a_decompression_bomb_is_refused_from_its_header_before_any_pixel_is_decoded():
    data = _bomb_png(40_000, 40_000)
    assert len(data) < 200
    with pytest.raises(ImageError, match=r"more pixels than the limit of 16777216 \(max_image_pixels\).*1600000000"):
        decode_image(data, where="tool 'zoom' result")
    # Under Pillow's own guard, over ours: refused by the header check, the size named.
    with pytest.raises(ImageError, match=r"5000x5000 = 25000000 pixels is over the limit of 16777216"):
        decode_image(_bomb_png(5000, 5000))


@pytest.mark.parametrize(("source", "limits", "match"), [
    (b"not an image at all", None, "not a readable image"),
    (_png(Image.new("RGB", (64, 64)))[:60], None, "corrupt|not a readable image"),
    (b"x" * 2048, ImageLimits(max_bytes=1024), "2048 bytes is over the limit of 1024 \\(max_image_bytes\\)"),
    ("https://example.com/cat.png", None, "remote image URLs are refused.*allow remote image URLs"),
    ("/etc/hostname", ImageLimits(allow_paths=False), "file path is not accepted here"),
    ("data:text/plain;base64,aGVsbG8=", None, "only image/\\* is an image"),
    ("data:image/png;base64,***", None, "base64 is invalid"),
    ("data:image/png,rawpixels", None, "must be 'data:image/<type>;base64,<data>'"),
    (12345, None, "an image must be a PIL image, bytes"),
    ({"nothing": 1}, None, "a mapping without 'bytes', 'path' or 'url'"),
    ("/no/such/file.png", None, "cannot read image file"),
])
def test_bad_images_are_refused_with_the_reason(source, limits, match):
    with pytest.raises(ImageError, match=match):
        decode_image(source, limits)


def test_a_large_image_under_the_pixel_limit_but_over_it_for_a_stricter_setting():
    picture = _picture(100, 100)
    assert decode_image(picture, ImageLimits(max_pixels=10_000)).size == (100, 100)
    with pytest.raises(ImageError, match="100x100 = 10000 pixels is over the limit of 9999"):
        decode_image(picture, ImageLimits(max_pixels=9_999))


@pytest.mark.parametrize(("field", "key"), [("max_pixels", "max_image_pixels"), ("max_bytes", "max_image_bytes"),
                                          ("max_images", "max_images")])
def test_limits_must_be_positive_integers_and_name_their_config_key(field, key):
    with pytest.raises(ValueError, match=f"^{key} must be a positive integer"):
        ImageLimits(**{field: 0})


# -- content parts --------------------------------------------------------------------------


def test_verl_rows_with_image_markers_become_image_parts_in_order():
    rows = [{"role": "system", "content": "Look."}, {"role": "user", "content": "<image>Compare with <image>."}]
    out = messages_with_row_images(rows, ["a", "b"])
    assert out[0] == rows[0]
    assert out[1]["content"] == [{"type": "image", "image": "a"}, {"type": "text", "text": "Compare with "},
                                 {"type": "image", "image": "b"}, {"type": "text", "text": "."}]
    with pytest.raises(ImageError, match="more <image> markers than the row's 1 image"):
        messages_with_row_images(rows, ["a"])
    with pytest.raises(ImageError, match="has 3 image\\(s\\).*but its prompt has 2 <image> marker"):
        messages_with_row_images(rows, ["a", "b", "c"])
    with pytest.raises(ImageError, match="videos are not supported"):
        messages_with_row_images([{"role": "user", "content": "<video>"}], [])


def test_an_images_column_read_by_pandas_is_a_numpy_array_and_pairs_up_the_same():
    """verl's geo3k parquet read with pandas: a row's ``images`` cell is a numpy object array,
    whose truth value is an error for two or more images."""
    import numpy as np

    rows = [{"role": "user", "content": "<image>Compare with <image>."}]
    cell = np.empty(2, dtype=object)
    cell[:] = [{"bytes": b"a", "path": None}, {"bytes": b"b", "path": None}]
    parts = messages_with_row_images(rows, cell)[0]["content"]
    assert [p.get("image") for p in parts if p["type"] == "image"] == list(cell)
    assert messages_with_row_images([{"role": "user", "content": "plain"}], np.empty(0, dtype=object))[0]["content"] == "plain"


def test_conversation_images_decode_each_source_once_and_count_every_part(tiny):
    _, processor = tiny
    picture = _picture(60, 60)
    images = ConversationImages(processor, ImageLimits(max_images=3))
    first = images.take([{"role": "user", "content": [{"type": "image", "image": picture}]}])
    again = images.take([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": picture}}]}],
                        count=False)
    ref = first[0]["content"][0]
    assert ref == again[0]["content"][0]
    assert ref["image"].startswith("sha256:")
    assert len(images.items) == 1
    assert images.count == 1
    images.take([{"role": "tool", "content": [ref, ref]}])
    assert images.count == 3
    with pytest.raises(ImageError, match="more than 3 images in one trajectory .*max_images"):
        images.take([{"role": "tool", "content": [ref]}])
    assert images.count == 3  # a refused call leaves the count as it was
    with pytest.raises(ImageError, match="video parts are not supported"):
        images.take([{"role": "user", "content": [{"type": "video", "video": "x"}]}])
    with pytest.raises(ImageError, match="never took"):
        images.in_messages([{"role": "user", "content": [{"type": "image", "image": "sha256:" + "0" * 32}]}])


def test_an_image_for_a_text_only_model_names_the_fix():
    with pytest.raises(ImageError, match="text-only model; use a vision-language model"):
        ConversationImages(None).take([{"role": "user", "content": [{"type": "image", "image": _picture(8, 8)}]}])


def test_generate_arguments_for_images_and_their_checks(tiny):
    _, processor = tiny
    item = processor.process(_picture(56, 56))
    assert multi_modal_kwargs([]) == {}
    assert multi_modal_kwargs([item]) == {"multi_modal_data": {"image": [item]}}
    assert images_of({"image": [item]}) == (item,)
    with pytest.raises(ValueError, match="takes only 'image' .*videos are not supported"):
        images_of({"video": [item]})
    with pytest.raises(ValueError, match="is a str, not an ImageItem"):
        images_of({"image": ["x.png"]})


# -- trajectories with images ---------------------------------------------------------------

TOOLS = [{"type": "function", "function": {"name": "zoom", "description": "Crop the image.",
                                           "parameters": {"type": "object", "properties": {}}}}]


def _turn(tokenizer, text: str) -> TokenOutput:
    ids = tokenizer.encode(text, add_special_tokens=False)
    return TokenOutput(ids, [-0.5] * len(ids))


def _three_image_trajectory(tokenizer, processor, **renderer_kwargs) -> Trajectory:
    renderer = ChatRenderer(tokenizer, tools=TOOLS, vision=processor, **renderer_kwargs)
    prompt = [{"role": "system", "content": "You see images."},
              {"role": "user", "content": [{"type": "image", "image": _png(_picture(150, 100, 1))},
                                           {"type": "text", "text": "What is in the corner?"}]}]
    call = '<tool_call>\n{"name": "zoom", "arguments": {}}\n</tool_call><|im_end|>'
    trajectory = Trajectory(renderer, prompt, sanity_check="strict")
    trajectory.append_generated(_turn(tokenizer, call))
    trajectory.append_messages([{"role": "tool", "name": "zoom", "content": [
        {"type": "text", "text": "Zoomed:"}, {"type": "image", "image": _picture(60, 60, 2)}]}])
    trajectory.append_generated(_turn(tokenizer, call))
    trajectory.append_messages([{"role": "tool", "name": "zoom", "content": [
        {"type": "image_url", "image_url": {"url": _data_url(_picture(90, 40, 3))}}]}])
    trajectory.append_generated(_turn(tokenizer, "A red square.<|im_end|>"))
    return trajectory


@pytest.mark.parametrize("delta_strategy", ["auto", "history", "short"])
def test_images_in_the_prompt_and_two_tool_results_pass_the_strict_check(tiny, delta_strategy):
    tokenizer, processor = tiny
    trajectory = _three_image_trajectory(tokenizer, processor, delta_strategy=delta_strategy)
    out = trajectory.to_output(sanity_check="strict")
    items = out.multi_modal_data["image"]
    assert [item.image.size for item in items] == [(150, 100), (60, 60), (90, 40)]
    assert all(isinstance(item, ImageItem) for item in items)
    ids = out.prompt_ids + out.response_ids
    pad = processor.image_token_id
    assert ids.count(pad) == sum(item.num_tokens for item in items)
    # Every image token after the prompt is a rendered token: mask 0.
    assert all(m == 0 for t, m in zip(out.response_ids, out.response_mask, strict=True) if t == pad)
    assert out.response_ids.count(pad) == items[1].num_tokens + items[2].num_tokens
    # The placeholders expand where the template put the images, in order.
    runs, run = [], 0
    for t in ids:
        if t == pad:
            run += 1
        elif run:
            runs.append(run)
            run = 0
    assert runs == [item.num_tokens for item in items]
    # The full re-encode (not only the turn-by-turn check) agrees.
    assert trajectory._full_check("strict") == SanityCheckReport(ok=True, mode="strict", canonical=True)


def test_the_inference_view_check_renders_the_images_of_the_whole_conversation(tiny):
    tokenizer, processor = tiny
    trajectory = _three_image_trajectory(tokenizer, processor, use_inference_chat_template=True)
    report = trajectory.sanity_check("strict")
    assert report.ok, report.describe()


def test_a_check_fails_when_an_image_token_is_lost(tiny):
    tokenizer, processor = tiny
    trajectory = _three_image_trajectory(tokenizer, processor)
    at = trajectory.response_ids.index(processor.image_token_id)
    del trajectory.response_ids[at], trajectory.response_mask[at]
    assert trajectory.response_logprobs is not None
    del trajectory.response_logprobs[at]
    assert not trajectory.sanity_check("strict").ok


def test_placeholder_text_in_a_text_part_is_text_not_image_tokens(tiny):
    tokenizer, processor = tiny
    renderer = ChatRenderer(tokenizer, tools=TOOLS, vision=processor)
    trajectory = Trajectory(renderer, [{"role": "user", "content": "Hi"}], sanity_check="strict")
    trajectory.append_generated(_turn(tokenizer, "Hello<|im_end|>"))
    ids = trajectory.append_messages([{"role": "user", "content": "look <|image_pad|> here"}])
    assert processor.image_token_id not in ids
    assert "look <|image_pad|> here" in tokenizer.decode(ids)
    assert trajectory.to_output(sanity_check="strict").multi_modal_data is None


def test_placeholder_text_in_a_text_part_is_refused_when_special_tokens_are_allowed_in_content(tiny):
    tokenizer, processor = tiny
    renderer = ChatRenderer(tokenizer, tools=TOOLS, vision=processor, allow_special_tokens_in_content=True)
    trajectory = Trajectory(renderer, [{"role": "user", "content": "Hi"}])
    trajectory.append_generated(_turn(tokenizer, "Hello<|im_end|>"))
    with pytest.raises(ImageError, match="1 image placeholder\\(s\\) '<\\|image_pad\\|>' but 0 image"):
        trajectory.append_messages([{"role": "user", "content": "look <|image_pad|> here"}])


def test_a_text_only_renderer_refuses_images_with_the_fix(tiny):
    tokenizer, _ = tiny
    renderer = ChatRenderer(tokenizer)
    with pytest.raises(ImageError, match="text-only model"):
        Trajectory(renderer, [{"role": "user", "content": [{"type": "image", "image": _picture(8, 8)}]}])


def test_a_preview_counts_its_own_images_against_the_limit(tiny):
    _, processor = tiny
    images = ConversationImages(processor, ImageLimits(max_images=2))
    two_more = [{"role": "tool", "content": [{"type": "image", "image": _picture(56, 56, k)} for k in range(3)]}]
    with pytest.raises(ImageError, match="more than 2 images"):
        images.take(two_more, count=False)
    assert images.count == 0


def test_a_preview_then_append_decodes_once_and_counts_once(tiny):
    tokenizer, processor = tiny
    renderer = ChatRenderer(tokenizer, tools=TOOLS, vision=processor)
    trajectory = Trajectory(renderer, [{"role": "user", "content": "Hi"}], image_limits=ImageLimits(max_images=1))
    trajectory.append_generated(_turn(tokenizer, "Hello<|im_end|>"))
    message = [{"role": "user", "content": [{"type": "image", "image": _picture(56, 56)}]}]
    preview = trajectory.preview_messages(message)
    assert trajectory.append_messages(message) == preview
    assert trajectory.images.count == 1
    assert len(trajectory.image_items) == 1


def test_vision_families_are_plug_ins(tmp_path):
    """A family arrives by entry point (found by load_vision_processor), a second factory for a
    taken model_type is refused, and a broken entry point is named in the error."""
    import json
    import sys

    from agentloop_core.testing.plugin_dist import write_distribution
    from agentloop_core.vision import load_vision_processor, register_vision_family, vision_families
    from agentloop_core.vision import processor as vision_processor

    with pytest.raises(ValueError, match="vision family name 'qwen2_vl' is already registered"):
        register_vision_family("qwen2_vl")(lambda folder, tokenizer: None)
    source = """
        def factory(folder, tokenizer):
            return ("demo processor", folder.name)
    """
    root = write_distribution(tmp_path / "site", "agentloop-demo-vision", modules={"agentloop_demo_vision": source},
                              entry_points={"agentloop.vision_families": {
                                  "demo_vl": "agentloop_demo_vision:factory",
                                  "broken_vl": "agentloop_demo_vision_missing:factory"}})
    for name, model_type in (("demo", "demo_vl"), ("broken", "broken_vl")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps({"model_type": model_type, "vision_config": {}}))
    saved = vision_processor._REGISTRY.snapshot()
    sys.path.insert(0, str(root))
    try:
        assert "demo_vl" in vision_families()
        assert load_vision_processor(tmp_path / "demo", None) == ("demo processor", "demo")
        with pytest.raises(ValueError, match=r"'broken_vl' \(entry point 'agentloop_demo_vision_missing:factory' "
                                             r"failed to import: ModuleNotFoundError"):
            load_vision_processor(tmp_path / "broken", None)
    finally:
        sys.path.remove(str(root))
        sys.modules.pop("agentloop_demo_vision", None)
        vision_processor._REGISTRY.restore(saved)
    assert "demo_vl" not in vision_processor._REGISTRY.entries
