"""Tiled images (Idefics3/SmolVLM) in the trajectory viewer: a real trajectory of the tiny
Idefics3 model, whose images each fill several runs of image tokens (one per tile and one for the
global view, the tiles' text between them), through trajectory_records and the page; and records
whose runs are hostile or inconsistent refused, marked, and their tokens shown one by one."""

from __future__ import annotations

import asyncio
import re
from types import SimpleNamespace

import pytest

Image = pytest.importorskip("PIL.Image")

from agentloop_trainer.view import render_html, trajectory_records  # noqa: E402
from agentloop_trainer.view.image_runs import MAX_RUNS, image_token_places  # noqa: E402
from agentloop_trainer.view.viewer_input import check_records  # noqa: E402

IMG = 7
"""The image token id of the hand-written records."""


def picture(w: int, h: int, seed: int):
    import numpy as np

    return Image.fromarray((np.random.RandomState(seed).rand(h, w, 3) * 255).astype("uint8"))


def section(page: str, index: int) -> str:
    return page.split(f'id="traj-{index}"')[1].split("</section>")[0]


def markers(traj: str) -> list[tuple[str, int, int, int]]:
    """(class, image number, first token, token count) of each image marker of the token view."""
    return [(m[1], int(m[2]), int(m[3]), int(m[4])) for m in re.finditer(
        r'<span class="(tok img(?: more)?)" data-image="(\d+)" data-i="(\d+)" data-n="(\d+)"', traj)]


@pytest.fixture(scope="module")
def tiled_rollout():
    """One tiny-Idefics3 trajectory: a 100x70 image (2 x 2 tiles + global view) in the prompt, a
    128x40 one (1 x 2 + global) in a tool result, generated turn by turn on HFServer."""
    pytest.importorskip("torch")
    from agentloop_core.batch import RolloutBatch
    from agentloop_core.tokenization import ChatRenderer, Trajectory
    from agentloop_core.vision import TiledImageItem, load_vision_processor, multi_modal_kwargs
    from agentloop_engines.adapters.hf.server import HFServer
    from agentloop_engines.testing.tiny_vlm import build_tiny_vlm

    path = build_tiny_vlm(family="idefics3")
    server = HFServer(path)
    vision = load_vision_processor(path, server.tokenizer)
    renderer = ChatRenderer(server.tokenizer, vision=vision)
    t = Trajectory(renderer, [{"role": "user", "content": [
        {"type": "image", "image": picture(100, 70, 1)}, {"type": "text", "text": "What is it?"}]}])

    async def run() -> None:
        for k in range(2):
            out = await server.generate("tiled", t.context_ids, {"max_tokens": 3, "seed": k},
                                        **multi_modal_kwargs(t.image_items))
            t.append_generated(out)
            if k == 0:
                t.append_messages([{"role": "user", "content": [
                    {"type": "text", "text": "Zoomed:"}, {"type": "image", "image": picture(128, 40, 2)}]}])

    asyncio.run(run())
    items = t.image_items
    assert all(isinstance(item, TiledImageItem) for item in items)
    assert [item.run_lengths for item in items] == [(4,) * 5, (4,) * 3]
    batch = RolloutBatch.from_outputs([t.to_output(extra_fields={"messages": t.messages})], pad_token_id=0)
    records = trajectory_records(batch, [{"group_id": "tiled-0", "rollout_n": 0}], server.tokenizer, step=1)
    return SimpleNamespace(items=items, record=records[0], vision=vision)


def test_a_tiled_image_records_every_run_and_its_first_runs_start(tiled_rollout):
    """Per image: token_start is its first run's start and token_runs each run, exactly where the
    ids hold the image token (the tiles' text between); num_tokens the sum. Debug:
    image_token_places in view/image_runs.py against core's image_token_runs."""
    record, items = tiled_rollout.record, tiled_rollout.items
    ids = record["prompt_ids"] + record["response_ids"]
    token = tiled_rollout.vision.image_token_id
    all_runs = []
    for item, entry in zip(items, record["images"], strict=True):
        runs = entry["token_runs"]
        assert [n for _, n in runs] == list(item.run_lengths)
        assert entry["token_start"] == runs[0][0]
        assert entry["num_tokens"] == item.num_tokens == sum(item.run_lengths)
        for start, n in runs:
            assert ids[start:start + n] == [token] * n
            assert ids[start - 1] != token
            assert ids[start + n] != token
        all_runs += [tuple(r) for r in runs]
    assert sorted(all_runs) == [(k, n) for k, n in _runs(ids, token)]  # every run of the ids, none twice
    assert record["images"][1]["token_start"] >= len(record["prompt_ids"])  # the tool result's image


def _runs(ids, token):
    out, k = [], 0
    while k < len(ids):
        if ids[k] == token:
            start = k
            while k < len(ids) and ids[k] == token:
                k += 1
            out.append((start, k - start))
        else:
            k += 1
    return out


def test_the_page_labels_a_tiled_image_once_at_its_first_run_and_marks_its_other_runs(tiled_rollout):
    """The token view shows the image's label (and its one thumbnail, in its message) once, at
    its first run; each further run is a marker of the same image ("run j of n"); the tiles' text
    between runs shows as tokens, and no image token shows alone. Debug: _image_marker and
    _tokens_html in trajectory_html.py."""
    record, items = tiled_rollout.record, tiled_rollout.items
    page = render_html([record])
    traj = section(page, 0)
    found = markers(traj)
    expected = []
    for number, entry in enumerate(record["images"], 1):
        for j, (start, n) in enumerate(entry["token_runs"]):
            expected.append(("tok img" if j == 0 else "tok img more", number, start, n))
    assert found == expected
    for number, item in enumerate(items, 1):
        w, h = item.image.size
        assert traj.count(f"[image {number}: {w}x{h}, {item.num_tokens} tokens]") == 1
        assert traj.count(f'<figure class="thumb" data-image="{number}">') == 1
        runs = len(item.run_lengths)
        assert [f"[image {number}, run {j} of {runs}]" in traj for j in range(2, runs + 1)] == [True] * (runs - 1)
    assert ">&lt;image&gt;<" not in traj  # every image token is inside a marker
    assert "&lt;row_1_col_2&gt;" in traj  # the tiles' names between the runs show
    assert 'id="problems"' not in page


def test_the_runs_found_are_exactly_core_image_token_runs_or_none():
    """Hand-made ids: a 3-run image and a 1-run image are placed run by run; ids whose runs are
    not the images' run lengths in order (a tile missing, the images swapped) place nothing."""
    from agentloop_core.vision import ImageItem, TiledImageItem

    tiled = TiledImageItem(image=None, digest="sha256:" + "a" * 32, num_tokens=6, rows=1, cols=2, tokens_per_tile=2)
    flat = ImageItem(image=None, digest="sha256:" + "b" * 32, num_tokens=3)
    ids = [1, 50, IMG, IMG, 51, IMG, IMG, 9, 52, IMG, IMG, 53, 2, IMG, IMG, IMG, 4]
    assert image_token_places(ids, [tiled, flat], IMG) == [((2, 2), (5, 2), (9, 2)), ((13, 3),)]
    assert image_token_places(ids, [tiled, flat]) == [((2, 2), (5, 2), (9, 2)), ((13, 3),)]  # token found
    assert image_token_places(ids, [flat, tiled], IMG) is None
    assert image_token_places(ids[:8] + ids[12:], [tiled, flat], IMG) is None


def _record(**fields):
    """A hand-written record with one tiled image: runs at 2..3, 5..6 (prompt) and 9..10 (response)."""
    entry = {"digest": "sha256:" + "c" * 32, "width": 40, "height": 30, "num_tokens": 6, "token_start": 2,
             "token_runs": [[2, 2], [5, 2], [9, 2]], **fields}
    return {"trajectory_index": 0, "reward": 1.0, "prompt_ids": [1, 50, IMG, IMG, 51, IMG, IMG, 3],
            "response_ids": [52, IMG, IMG, 4, 5], "response_mask": [0, 0, 0, 1, 1], "images": [entry]}


def test_a_hand_written_tiled_record_renders_one_label_and_two_further_runs():
    page = render_html([_record()])
    assert markers(section(page, 0)) == [("tok img", 1, 2, 2), ("tok img more", 1, 5, 2), ("tok img more", 1, 9, 2)]
    assert 'id="problems"' not in page


BAD_RUNS = {
    "not a list": ("2-3,5-6", "token_runs must be a list"),
    "a run that is no pair": ([[2, 2], [5], [9, 2]], "token_runs must be a list"),
    "too many runs": ([[2, 2]] * (MAX_RUNS + 1), "token_runs must be a list"),
    "first run elsewhere": ([[5, 2], [9, 2], [11, 2]], "not at token_start 2"),
    "lengths that do not add up": ([[2, 2], [5, 2], [9, 1]], "runs of 5 tokens for an image of 6"),
    "runs out of order": ([[2, 2], [9, 2], [5, 2]], "runs out of order"),
    "a run over text": ([[2, 2], [6, 2], [9, 2]], "tokens 6..7 are not one image token repeated"),
    "a run past the end": ([[2, 2], [5, 2], [12, 2]], "within the 13 token ids"),
    "a run over generated tokens": ([[2, 2], [5, 2], [11, 2]], "not one image token repeated"),
    "a run of no tokens": ([[2, 2], [5, 0], [9, 4]], "a run of no tokens"),
}


@pytest.mark.parametrize("name", list(BAD_RUNS))
def test_hostile_or_inconsistent_runs_place_nothing_and_are_listed(name):
    """A token_runs that is not a list of in-order [start, length] pairs, each one image token
    repeated, adding up to num_tokens and starting at token_start, places no marker: the tokens
    show one by one and the problem is listed under images[0].token_runs."""
    value, why = BAD_RUNS[name]
    record = _record(token_runs=value)
    checked, problems = check_records([record])
    assert checked[0]["images"][0].token_runs == ()
    assert any("images[0].token_runs" in p and why in p for p in problems), problems
    page = render_html([_record(token_runs=value)])
    assert markers(section(page, 0)) == []
    assert section(page, 0).count('class="tok ') == 13


def test_runs_of_two_ids_or_over_the_masked_response_are_refused():
    """The same image's runs must be one token id; a run in the response must have mask 0."""
    record = _record()
    record["prompt_ids"][5:7] = [8, 8]
    assert any("runs are of different token ids" in p for p in check_records([record])[1])
    record = {**_record(), "response_mask": [0, 1, 0, 1, 1]}
    assert any("must have mask 0" in p for p in check_records([record])[1])
