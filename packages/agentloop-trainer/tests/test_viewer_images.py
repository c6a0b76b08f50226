"""Images in the trajectory viewer: a real trajectory of the tiny VLM (an image in the prompt and
in two tool results) through trajectory_records and the page; hostile image fields refused or
escaped and marked; and the thumbnails drawn by headless Chromium (skipped, with the reason,
without Chromium or Playwright, as in test_viewer_browser.py)."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import re
import shutil
import struct
import zlib
from types import SimpleNamespace

import pytest

Image = pytest.importorskip("PIL.Image")

from agentloop_trainer.view import images as view_images  # noqa: E402
from agentloop_trainer.view import render_html, trajectory_records, write_jsonl, write_view  # noqa: E402
from agentloop_trainer.view.viewer_input import check_records  # noqa: E402

RED, BLUE = (220, 30, 30), (30, 30, 220)
TOOLS = [{"type": "function", "function": {"name": "zoom", "description": "Crop the image.",
                                           "parameters": {"type": "object", "properties": {}}}}]
SRC = re.compile(r'\ssrc="([^"]*)"')


def picture(w: int, h: int, colour: tuple[int, int, int]):
    """A ``colour`` image with a white top-left quarter (so a thumbnail's orientation shows)."""
    import numpy as np

    a = np.zeros((h, w, 3), "uint8")
    a[:] = colour
    a[: h // 2, : w // 2] = 255
    return Image.fromarray(a)


def png_b64(image) -> str:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode()


def section(page: str, index: int) -> str:
    return page.split(f'id="traj-{index}"')[1].split("</section>")[0]


def messages_of(traj: str) -> list[str]:
    """The HTML of each message of a trajectory's conversation, in order."""
    return traj.split('<div class="messages">')[1].split("<h3>")[0].split('<div class="msg ')[1:]


def decode_src(src: str):
    """A page's image URL as a decoded image: it must be a PNG or JPEG data URL of plain base64."""
    m = re.fullmatch(r"data:image/(png|jpeg);base64,([A-Za-z0-9+/]+={0,2})", src)
    assert m, f"not a data URL the viewer builds: {src[:60]}"
    image = Image.open(io.BytesIO(base64.b64decode(m[2])), formats=[m[1].upper()])
    image.load()
    return image


@pytest.fixture(scope="module")
def vlm_rollout():
    """One tiny-VLM trajectory (red 150x100 image in the prompt; blue 60x60, then the red image
    again, in two tool results) and a text-only one; their records and the processor."""
    pytest.importorskip("torch")
    from agentloop_core.batch import RolloutBatch
    from agentloop_core.tokenization import ChatRenderer, Trajectory
    from agentloop_core.vision import load_vision_processor, multi_modal_kwargs
    from agentloop_engines.adapters.hf.server import HFServer
    from agentloop_engines.testing.tiny_vlm import build_tiny_vlm

    path = build_tiny_vlm()
    server = HFServer(path)
    vision = load_vision_processor(path, server.tokenizer)
    renderer = ChatRenderer(server.tokenizer, tools=TOOLS, vision=vision)
    with_images = Trajectory(renderer, [{"role": "user", "content": [
        {"type": "image", "image": picture(150, 100, RED)}, {"type": "text", "text": "What is in the corner?"}]}])
    text_only = Trajectory(renderer, [{"role": "user", "content": "Count to three."}])
    results = [picture(60, 60, BLUE), picture(150, 100, RED)]

    async def run() -> None:
        for k in range(3):
            for t in (with_images, text_only):
                out = await server.generate(f"r{id(t)}", t.context_ids, {"max_tokens": 4, "seed": k},
                                            **multi_modal_kwargs(t.image_items))
                t.append_generated(out)
            if k < 2:
                with_images.append_messages([{"role": "tool", "name": "zoom", "content": [
                    {"type": "text", "text": "Zoomed:"}, {"type": "image", "image": results[k]}]}])
                text_only.append_messages([{"role": "user", "content": "Go on."}])

    asyncio.run(run())
    outputs = [t.to_output(extra_fields={"messages": t.messages}) for t in (with_images, text_only)]
    batch = RolloutBatch.from_outputs(outputs, pad_token_id=0)
    rows = [{"group_id": "vlm-0", "rollout_n": n} for n in range(2)]
    return SimpleNamespace(outputs=outputs, records=trajectory_records(batch, rows, server.tokenizer, step=1),
                           vision=vision)


def test_records_carry_each_image_as_a_small_thumbnail_where_it_entered(vlm_rollout):
    """Per image: digest, size as it entered, token count, message index/role of its image part,
    where its token run starts, and a base64 thumbnail (longest side <= 128); a text-only record
    has no images field. Debug: record_images in view/images.py."""
    record, text_only = vlm_rollout.records
    items = vlm_rollout.outputs[0].multi_modal_data["image"]
    assert len(items) == len(record["images"]) == 3
    assert "images" not in text_only
    ids = record["prompt_ids"] + record["response_ids"]
    where = [(0, "user"), (2, "tool"), (4, "tool")]
    for item, entry, (index, role) in zip(items, record["images"], where, strict=True):
        assert entry["digest"] == item.digest
        assert (entry["width"], entry["height"]) == item.image.size
        assert entry["num_tokens"] == item.num_tokens
        assert (entry["message_index"], entry["role"]) == (index, role)
        run = ids[entry["token_start"]:entry["token_start"] + item.num_tokens]
        assert run == [vlm_rollout.vision.image_token_id] * item.num_tokens
        thumb = Image.open(io.BytesIO(base64.b64decode(entry["thumbnail"])))
        assert thumb.format.lower() == entry["thumbnail_type"]
        assert max(thumb.size) <= view_images.THUMBNAIL_SIDE
    assert record["images"][0]["digest"] == record["images"][2]["digest"]  # the red image, twice
    assert len(json.dumps(record)) < 20_000


def test_the_page_shows_each_thumbnail_beside_its_message_and_one_marker_per_token_run(vlm_rollout):
    """The conversation shows N thumbnails, each in the message that carried it, each a valid
    image of the right colour; the token view shows one labelled marker per image instead of its
    run of image tokens. Debug: trajectory_html's _content_html and _tokens_html."""
    record = vlm_rollout.records[0]
    page = render_html(vlm_rollout.records)
    traj = section(page, 0)
    assert len(re.findall(r'<figure class="thumb" data-image=', traj)) == 3
    messages = messages_of(traj)
    assert len(messages) == 6
    for number, (index, role) in zip((1, 2, 3), [(0, "user"), (2, "tool"), (4, "tool")], strict=True):
        assert messages[index].startswith(f'role-{role}"><div class="role">{role}')
        assert messages[index].count("<figure") == 1
        assert f'<figure class="thumb" data-image="{number}">' in messages[index]
    srcs = SRC.findall(traj)
    assert len(srcs) == 3
    for src, size, colour in zip(srcs, [(128, 85), (60, 60), (128, 85)], [RED, BLUE, RED], strict=True):
        image = decode_src(src)
        assert image.size == size
        px = image.convert("RGB").getpixel((image.size[0] * 3 // 4, image.size[1] * 3 // 4))
        assert all(abs(a - b) < 40 for a, b in zip(px, colour, strict=True)), px
    items = vlm_rollout.outputs[0].multi_modal_data["image"]
    for number, item in enumerate(items, 1):
        w, h = item.image.size
        assert f"[image {number}: {w}x{h}, {item.num_tokens} tokens]" in traj
    assert traj.count('class="tok img"') == 3
    pad = vlm_rollout.vision.image_token
    assert f">{pad}<" not in traj  # every image token is inside a marker
    assert traj.count('class="tok gen"') == sum(record["response_mask"])
    assert "images</b> 3" in traj
    assert "data:image" not in section(page, 1)


def test_a_capped_record_counts_the_thumbnails_and_entries_it_left_out(monkeypatch):
    """At most MAX_THUMBNAILS thumbnails and MAX_IMAGE_ENTRIES entries per record; the page says
    how many were left out and shows images no message names below the messages."""
    monkeypatch.setattr(view_images, "MAX_THUMBNAILS", 2)
    monkeypatch.setattr(view_images, "MAX_IMAGE_ENTRIES", 3)
    items = [SimpleNamespace(image=picture(40 + k, 30, RED), digest=f"sha256:{k:032x}", num_tokens=2) for k in range(5)]
    ids = [1, 2] + [7, 7, 3] * 5 + [4]
    out = view_images.record_images({"image": items}, None, ids)
    assert len(out["images"]) == 3
    assert (out["images_omitted"], out["thumbnails_omitted"]) == (2, 1)
    assert [e["token_start"] for e in out["images"]] == [2, 5, 8]
    assert sum("thumbnail" in e for e in out["images"]) == 2
    record = {"prompt_ids": ids, "response_ids": [], **out}
    page = render_html([record])
    assert "2 images of this segment are not in this file" in page
    assert "1 image of this segment has no thumbnail in this file" in page
    assert "Images not in the messages above" in page
    assert page.count('<figure class="thumb" data-image=') == 2
    assert page.count('<figure class="thumb none" data-image=') == 1
    assert page.count('class="tok img"') == 3 + 1  # and the legend's


def test_the_image_token_is_found_without_a_tokenizer_and_ambiguity_collapses_nothing():
    """image_token_starts: the one id whose runs split into the images' counts; None when two
    ids would fit (nothing is collapsed rather than the wrong tokens)."""
    assert view_images.image_token_starts([5, 9, 9, 9, 6, 9, 9, 1], [3, 2]) == [1, 5]
    # Adjacent images of one run are no prompt any engine takes (core image_token_runs): not split.
    assert view_images.image_token_starts([5, 9, 9, 9, 9, 9, 1], [3, 2]) is None
    assert view_images.image_token_starts([5, 9, 6, 8], [1]) is None  # 5, 9, 6 and 8 all fit
    assert view_images.image_token_starts([5, 9, 6, 8], [1], token_id=9) == [1]
    assert view_images.image_token_starts([9, 9, 9], [2]) is None


def _bomb_png() -> str:
    """A PNG whose header declares 100000 x 100000 pixels (a few bytes that would decode to 30 GB)."""
    raw = base64.b64decode(png_b64(picture(4, 4, RED)))
    body = b"IHDR" + struct.pack(">II", 100_000, 100_000) + raw[24:29]
    return base64.b64encode(raw[:12] + body + struct.pack(">I", zlib.crc32(body)) + raw[33:]).decode()


def _jpeg_b64() -> str:
    buf = io.BytesIO()
    picture(8, 8, BLUE).save(buf, format="JPEG")
    return base64.b64encode(buf.getvalue()).decode()


HOSTILE_THUMBNAILS = {
    "javascript URL": ("javascript:alert(1)", "png"),
    "html data URL": ("data:text/html;base64,PHNjcmlwdD5hbGVydCgxKTwvc2NyaXB0Pg==", "png"),
    "image data URL": ("data:image/png;base64," + png_b64(picture(4, 4, RED)), "png"),
    "attribute injection": ('" onerror="alert(1)" x="', "png"),
    "script tag": ("\"><script>alert(1)</script>", "png"),
    "base64 of html": (base64.b64encode(b"<script>alert(1)</script>").decode(), "png"),
    "a jpeg called png": (_jpeg_b64(), "png"),
    "svg type": (png_b64(picture(4, 4, RED)), "svg+xml"),
    "type injection": (png_b64(picture(4, 4, RED)), '"><script>alert(1)</script>'),
    "huge base64": ("QUFB" * (view_images.MAX_THUMBNAIL_CHARS // 4 + 1), "png"),
    "too many pixels a side": (png_b64(picture(1000, 8, RED)), "png"),
    "decompression bomb": (_bomb_png(), "png"),
    "truncated png": (png_b64(picture(32, 32, RED))[:120], "png"),
    "a number": (12345, "png"),
    "a list": (["iVBORw0KGgo="], "png"),
    "an object": ({"src": "javascript:alert(1)"}, "png"),
}


def _record(**image_fields):
    """A small record with one good image (token run at 2..4) and one image with the given fields."""
    good = {"digest": "sha256:" + "a" * 32, "width": 40, "height": 30, "num_tokens": 3, "message_index": 0,
            "role": "user", "token_start": 2, "thumbnail": png_b64(picture(40, 30, RED)), "thumbnail_type": "png"}
    other = {**good, "digest": "sha256:" + "b" * 32, "token_start": 6, "num_tokens": 2, "message_index": 1,
             **image_fields}
    messages = [{"role": "user", "content": [{"type": "image", "image": good["digest"]}, {"type": "text", "text": "hi"}]},
                {"role": "tool", "content": [{"type": "image", "image": other["digest"]}]}]
    return {"trajectory_index": 0, "reward": 1.0, "prompt_ids": [1, 2, 7, 7, 7, 3], "response_ids": [7, 7, 4, 5],
            "response_mask": [0, 0, 1, 1], "messages": messages, "images": [good, other]}


def _assert_safe(page: str) -> None:
    """No markup from the data: every src is a data URL the viewer built, no script but its own."""
    for src in SRC.findall(page):
        decode_src(src)
    assert page.count("<script") == 1
    # An attribute is only ever inside a tag; text from the file has no raw < or > to open one.
    assert not re.search(r"(?i)<[^<>]*\son[a-z]+\s*=", page)
    assert not re.search(r"(?i)<[^<>]*\s(href|src)\s*=\s*\"?\s*(javascript|data:text)", page)


@pytest.mark.parametrize("name", list(HOSTILE_THUMBNAILS))
def test_a_hostile_thumbnail_is_refused_marked_and_the_rest_still_shows(name):
    """Each bad thumbnail is refused (no img for it), shown marked and listed; the good image and
    the tokens still show. Debug: thumbnail_src in view/images.py."""
    value, kind = HOSTILE_THUMBNAILS[name]
    page = render_html([_record(thumbnail=value, thumbnail_type=kind)])
    _assert_safe(page)
    traj = section(page, 0)
    assert len(SRC.findall(traj)) == 1  # the good image only
    bad = messages_of(traj)[1]
    assert bad.startswith('role-tool"><div class="role">tool</div><figure class="thumb bad" data-image="2">'
                          '<span class="tok bad"')
    assert "images[1].thumbnail" in page.split('id="problems"')[1].split("</details>")[0]
    assert traj.count('class="tok img"') == 2
    assert traj.count('class="tok gen"') == 2
    assert len(page) < 100_000


HOSTILE_FIELDS = {
    "digest": ('"><script>alert(1)</script>', "images[1].digest"),
    "role": ("<img src=x onerror=alert(1)>", None),
    "width": ("150", "images[1].width"),
    "num_tokens": (-3, "images[1].num_tokens"),
    "message_index": ("0", "images[1].message_index"),
    "token_start": ("6", "images[1].token_start"),
}


@pytest.mark.parametrize("field", list(HOSTILE_FIELDS))
def test_hostile_image_fields_are_escaped_and_marked(field):
    """A wrong type or markup in any image field is escaped, listed and shown marked."""
    value, listed = HOSTILE_FIELDS[field]
    page = render_html([_record(**{field: value})])
    _assert_safe(page)
    problems = page.split('id="problems"')[1].split("</details>")[0] if 'id="problems"' in page else ""
    if listed:
        assert listed in problems
    assert "<script>alert" not in page
    assert "<img src=x" not in page
    assert len(SRC.findall(section(page, 0))) == 2


@pytest.mark.parametrize(("start", "mask", "why"), [
    (4, [0, 0, 1, 1], "tokens 4..5 are not one image token repeated"), (9, [0, 0, 1, 1], "within the 10 token ids"),
    (3, [0, 0, 1, 1], "overlaps another image"), (6, [1, 0, 1, 1], "image tokens in the response must have mask 0")])
def test_a_token_position_that_is_no_image_run_collapses_nothing(start, mask, why):
    """A token_start must point at a run of one repeated id inside the ids (mask 0 in the response),
    apart from the other images' runs; else the tokens show one by one and the value is listed."""
    page = render_html([{**_record(token_start=start), "response_mask": mask}])
    assert why in page
    assert section(page, 0).count('class="tok img"') == 1
    assert section(page, 0).count('class="tok ') == 1 + 10 - 3  # every other token shown


def test_malformed_image_lists_and_parts_are_marked_not_dropped():
    """``images`` of the wrong type, an entry that is no object, a count that is no count, and
    message image parts naming unknown or non-text images: listed, shown escaped."""
    record = _record()
    record["images"].append(42)
    record["images_omitted"] = "lots"
    record["messages"].append({"role": "user", "content": [
        {"type": "image", "image": '"><script>alert(1)</script>'},
        {"type": "image_url", "image_url": {"url": "javascript:alert(1)"}},
        {"type": "image", "image": {"src": "x"}}]})
    page = render_html([record, {**_record(), "trajectory_index": 1, "images": "<b>not a list</b>"}])
    _assert_safe(page)
    checked, problems = check_records([record])
    assert any("images[2]" in p for p in problems)
    assert any("images_omitted" in p for p in problems)
    assert "an image not in this file" in page
    assert "&lt;b&gt;not a list&lt;/b&gt;" in page
    assert "javascript:alert(1)" in page  # as escaped text in a pre, never an attribute
    assert checked[0]["images"][2].digest.why.startswith("not an image entry")


def test_a_written_jsonl_of_images_renders_the_same(vlm_rollout, tmp_path):
    """The records survive the JSONL: `agentloop view` on the file shows the same thumbnails."""
    out = write_view(write_jsonl(vlm_rollout.records, tmp_path / "v.jsonl"))
    assert len(SRC.findall(out.read_text())) == 3


# -- in a browser -------------------------------------------------------------------------------

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.fixture(scope="module")
def browser():
    sync_api = pytest.importorskip("playwright.sync_api", reason="needs playwright: pip install 'agentloop-trainer[test]'")
    if CHROMIUM is None:
        pytest.skip("no chromium on PATH (Debian: apt-get install -y chromium)")
    with sync_api.sync_playwright() as p:
        # --no-sandbox: CI containers run as root, where Chromium's sandbox refuses to start.
        b = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        yield b
        b.close()


def _open(browser, records, tmp_path):
    out = write_view(write_jsonl(records, tmp_path / "r.jsonl"))
    context = browser.new_context(offline=True, viewport={"width": 1280, "height": 900})
    requests, errors = [], []
    context.on("request", lambda r: requests.append(r.url))
    page = context.new_page()
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(out.resolve().as_uri())
    return context, page, requests, errors


def test_chromium_draws_each_thumbnail(browser, vlm_rollout, tmp_path):
    """Every thumbnail loads (naturalWidth > 0, under the page's Content-Security-Policy) and its
    pixels in a screenshot have the picture's colour; nothing is fetched. The screenshot is left
    at tmp_path/images.png."""
    context, page, requests, errors = _open(browser, vlm_rollout.records, tmp_path)
    thumbs = page.locator("#traj-0 img.thumb-img")
    assert thumbs.count() == 3
    sizes = thumbs.evaluate_all("imgs => imgs.map(i => [i.complete, i.naturalWidth, i.naturalHeight])")
    assert sizes == [[True, 128, 85], [True, 60, 60], [True, 128, 85]]
    page.screenshot(path=str(tmp_path / "images.png"))
    shot = Image.open(tmp_path / "images.png").convert("RGB")
    for k, colour in enumerate([RED, BLUE]):
        box = thumbs.nth(k).bounding_box()
        px = shot.getpixel((int(box["x"] + box["width"] * 0.75), int(box["y"] + box["height"] * 0.75)))
        assert all(abs(a - b) < 40 for a, b in zip(px, colour, strict=True)), (k, px)
        white = shot.getpixel((int(box["x"] + box["width"] * 0.25), int(box["y"] + box["height"] * 0.25)))
        assert min(white) > 215, (k, white)
    assert page.locator("#traj-0 .tok.img").count() == 3
    assert errors == []
    assert [u for u in requests if not u.startswith(("file://", "data:image/"))] == []
    context.close()


def test_chromium_runs_nothing_from_a_hostile_file(browser, tmp_path):
    """Markup and script in image fields do nothing in a real browser: no handler runs, no
    request leaves, the good thumbnail still draws."""
    payload = "<img src=x onerror=\"document.title='pwned'\"><script>document.title='pwned'</script>"
    records = [_record(thumbnail=f'" onerror="document.title=\'pwned\'" x="{payload}', role=payload, digest=payload)]
    records[0]["messages"].append({"role": payload, "content": [{"type": "image", "image": payload}]})
    context, page, requests, errors = _open(browser, records, tmp_path)
    assert page.title() != "pwned"
    assert page.locator("img").count() == 1
    assert page.locator("img.thumb-img").evaluate("i => i.naturalWidth") == 40
    assert page.locator("#traj-0 .thumb.bad").count() == 1
    assert errors == []
    assert [u for u in requests if not u.startswith(("file://", "data:image/"))] == []
    context.close()
