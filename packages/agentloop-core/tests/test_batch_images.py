"""Truncating rows that hold images (``RolloutBatch.from_outputs(truncate=True)``): a cut never
splits an image's tokens, the images whose tokens leave the row leave its ``multi_modal_data``,
and the images cut are counted. Stand-in images (no pixels needed: the batch reads only their
token runs) and a made-up image token id."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from agentloop_core.batch import RolloutBatch
from agentloop_core.output import AgentLoopOutput
from agentloop_core.vision import ImageItem, TiledImageItem

IMG = 99  # the image placeholder id of these rows
ARGS = {"pad_token_id": 0, "truncate": True}


def item(n: int, name: str) -> ImageItem:
    return ImageItem(image=None, digest=f"sha256:{name}", num_tokens=n)


def tiled(name: str) -> TiledImageItem:
    """Two tiles and the global view, 2 tokens each: runs [2, 2, 2] with tile names between."""
    return TiledImageItem(image=None, digest=f"sha256:{name}", num_tokens=6, rows=1, cols=2, tokens_per_tile=2)


def output(prompt: list[int], response: list[tuple[int, int]], images: list[ImageItem]) -> AgentLoopOutput:
    return AgentLoopOutput(prompt_ids=prompt, response_ids=[t for t, _ in response],
                           response_mask=[m for _, m in response],
                           response_logprobs=[-0.5 * m for _, m in response],
                           multi_modal_data={"image": images} if images else None, reward_score=1.0, num_turns=3)


A, B, C = item(3, "a"), item(4, "b"), item(2, "c")
# prompt: text, image A (3 tokens), text; response: generated, tool text + image B (4), generated,
# tool text + image C (2), generated.
PROMPT = [1, 2, 10, IMG, IMG, IMG, 11, 3, 4]
RESPONSE = ([(20, 1), (21, 1), (30, 0), (10, 0)] + [(IMG, 0)] * 4 + [(11, 0), (22, 1), (23, 1),
            (10, 0)] + [(IMG, 0)] * 2 + [(11, 0), (24, 1)])


def kept(batch: RolloutBatch, row: int = 0) -> tuple[list[int], list[int], list[int]]:
    """The row's prompt, response and mask as the padding left them."""
    P = batch.prompts.shape[1]
    attn = batch.attention_mask[row]
    return (batch.prompts[row][attn[:P] == 1].tolist(), batch.responses[row][attn[P:] == 1].tolist(),
            batch.response_mask[row][attn[P:] == 1].tolist())


def images_fill(prompt: list[int], response: list[int], data) -> bool:
    images = (data or {}).get("image") or []
    return (prompt + response).count(IMG) == sum(i.num_tokens for i in images)


def test_a_response_cut_inside_a_tool_image_ends_before_it_and_drops_it_and_the_later_ones(caplog):
    out = output(PROMPT, RESPONSE, [A, B, C])
    first_b = [t for t, _ in RESPONSE].index(IMG)
    batch = RolloutBatch.from_outputs([out], response_length=first_b + 2, **ARGS)
    prompt, response, mask = kept(batch)
    assert prompt == PROMPT
    assert response == [t for t, _ in RESPONSE][:first_b]  # the run's two kept tokens went too
    assert mask == [m for _, m in RESPONSE][:first_b]
    assert batch.multi_modal_data[0] == {"image": [A]}
    assert images_fill(prompt, response, batch.multi_modal_data[0])
    assert batch.truncated.tolist() == [True]
    assert batch.metrics["rollout/num_truncated"] == 1
    assert batch.metrics["rollout/num_images_cut"] == 2
    assert "2 image(s) cut" in caplog.text
    assert out.multi_modal_data == {"image": [A, B, C]}  # the output itself is unchanged


def test_a_response_cut_between_images_keeps_the_images_before_it():
    out = output(PROMPT, RESPONSE, [A, B, C])
    R = len(RESPONSE) - 4  # inside the tool text before image C
    batch = RolloutBatch.from_outputs([out], response_length=R, **ARGS)
    prompt, response, _ = kept(batch)
    assert response == [t for t, _ in RESPONSE][:R]
    assert batch.multi_modal_data[0] == {"image": [A, B]}
    assert images_fill(prompt, response, batch.multi_modal_data[0])
    assert batch.metrics["rollout/num_images_cut"] == 1


def test_a_prompt_cut_inside_its_image_starts_after_it():
    out = output(PROMPT, RESPONSE, [A, B, C])
    batch = RolloutBatch.from_outputs([out], prompt_length=len(PROMPT) - 4, **ARGS)
    prompt, response, mask = kept(batch)
    assert prompt == [11, 3, 4]  # not the image's last tokens: the whole image left
    assert response == [t for t, _ in RESPONSE]
    assert mask == [m for _, m in RESPONSE]
    assert batch.multi_modal_data[0] == {"image": [B, C]}
    assert images_fill(prompt, response, batch.multi_modal_data[0])
    assert batch.metrics["rollout/num_images_cut"] == 1


def test_a_tiled_image_cut_between_its_tiles_leaves_whole():
    tile = tiled("t")
    prompt = [1, 50, IMG, IMG, 51, IMG, IMG, 52, IMG, IMG, 3]
    out = output(prompt, [(20, 1), (21, 1)], [tile])
    batch = RolloutBatch.from_outputs([out], prompt_length=6, **ARGS)  # cut between the tiles
    kept_prompt, response, _ = kept(batch)
    assert kept_prompt == [3]
    assert batch.multi_modal_data[0] is None
    assert images_fill(kept_prompt, response, batch.multi_modal_data[0])
    assert batch.metrics["rollout/num_images_cut"] == 1


def test_rows_that_fit_keep_their_images_and_text_batches_get_no_image_metric():
    out = output(PROMPT, RESPONSE, [A, B, C])
    batch = RolloutBatch.from_outputs([out], **ARGS)
    assert batch.multi_modal_data[0] is out.multi_modal_data
    assert batch.metrics["rollout/num_images_cut"] == 0
    text = output([1, 2], [(3, 1)], [])
    assert "rollout/num_images_cut" not in RolloutBatch.from_outputs([text], **ARGS).metrics


def test_a_cut_row_whose_images_do_not_fill_its_tokens_trains_nothing(caplog):
    """Images that were already wrong cannot be cut right: the row keeps its cut ids, loses its
    images and its mask (it trains nothing, so the trainer scores it as a stand-in)."""
    out = output(PROMPT, RESPONSE, [A, C])  # image B is missing
    with caplog.at_level(logging.WARNING):
        batch = RolloutBatch.from_outputs([out], response_length=len(RESPONSE) - 1, **ARGS)
    assert batch.multi_modal_data[0] is None
    assert not batch.response_mask[0].any()
    assert batch.rollout_log_probs is not None
    assert not batch.rollout_log_probs[0].any()
    assert batch.truncated.tolist() == [True]
    assert batch.metrics["rollout/num_images_cut"] == 2
    assert "do not fill its image tokens" in caplog.text


@pytest.mark.parametrize("R", range(1, len(RESPONSE) + 1))
def test_every_response_cut_keeps_ids_and_images_consistent_and_every_generated_token_before_it(R):
    out = output(PROMPT, RESPONSE, [A, B, C])
    batch = RolloutBatch.from_outputs([out], response_length=R, **ARGS)
    prompt, response, mask = kept(batch)
    assert images_fill(prompt, response, batch.multi_modal_data[0])
    assert response == [t for t, _ in RESPONSE][: len(response)]
    assert sum(mask) == sum(m for _, m in RESPONSE[:R])  # only image tokens (mask 0) moved with the cut
    assert batch.rollout_log_probs is not None
    np.testing.assert_array_equal(batch.rollout_log_probs[0][: len(mask)], [-0.5 * m for m in mask])
