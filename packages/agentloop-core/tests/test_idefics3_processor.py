"""Tiled images (Idefics3/SmolVLM): one image fills several runs of image tokens, which
``image_token_runs`` checks run by run; their features stack as one batch row, padded to a
common tile size; the family's processor needs its special tokens and registers itself."""

from __future__ import annotations

import numpy as np
import pytest

from agentloop_core.vision import ImageItem, TiledImageItem, image_token_runs, stack_features, vision_families

IMG = 7
"""The image token id of these tests."""


def _tiled(rows: int, cols: int, per_tile: int = 3, side: int = 4) -> TiledImageItem:
    tiles = rows * cols + 1
    return TiledImageItem(image=None, digest=f"sha256:{rows}{cols}", num_tokens=per_tile * tiles,
                          features={"pixel_values": np.ones((tiles, 3, side, side), np.float32),
                                    "pixel_attention_mask": np.ones((tiles, side, side), np.int64)},
                          rows=rows, cols=cols, tokens_per_tile=per_tile)


def _prompt(*items: TiledImageItem) -> list[int]:
    """Text token 1, then each image as its runs separated by marker tokens 2, then 1."""
    ids = [1]
    for item in items:
        for n in item.run_lengths:
            ids += [2, *[IMG] * n]
        ids.append(2)
    return [*ids, 1]


def test_a_tiled_image_spans_its_runs_and_the_next_image_starts_after_them():
    first, second = _tiled(1, 2), _tiled(0, 0)
    assert first.run_lengths == (3, 3, 3)
    assert second.run_lengths == (3,)
    ids = _prompt(first, second)
    (a_start, a_end), (b_start, b_end) = image_token_runs(ids, [first, second], IMG)
    assert ids[a_start] == IMG
    assert ids[a_end - 1] == IMG
    assert ids[a_start:a_end].count(IMG) == first.num_tokens
    assert (b_start, b_end) == (a_end + 2, a_end + 5)


def test_runs_that_do_not_match_the_tile_layout_are_refused_naming_both():
    """Same total of image tokens (9), another layout: refused, not filled with the wrong tiles."""
    with pytest.raises(ValueError, match=r"in 3 run\(s\) of \[3, 3, 3\] but its 1 image\(s\) fill \[9\]"):
        image_token_runs(_prompt(_tiled(1, 2)), [ImageItem(image=None, digest="sha256:x", num_tokens=9)], IMG)
    with pytest.raises(ValueError, match=r"fill \[3, 3, 3, 3, 3\]"):
        image_token_runs(_prompt(_tiled(1, 2)), [_tiled(2, 2)], IMG)


def test_tiled_features_stack_as_one_row_padded_to_the_largest_tile():
    small, large = _tiled(0, 0, side=4), _tiled(1, 1, side=6)
    out = stack_features([small, large])
    assert out["pixel_values"].shape == (1, 3, 3, 6, 6)
    assert out["pixel_attention_mask"].shape == (1, 3, 6, 6)
    assert out["pixel_attention_mask"][0, 0].sum() == 16  # the small tile's own 4 x 4 pixels, the rest padding
    assert out["pixel_values"][0, 0, :, 4:, :].sum() == 0


def test_untiled_features_of_other_shapes_are_an_error_not_padded():
    a = ImageItem(image=None, digest="sha256:a", num_tokens=1, features={"pixel_values": np.ones((4, 10))})
    b = ImageItem(image=None, digest="sha256:b", num_tokens=1, features={"pixel_values": np.ones((4, 8))})
    assert stack_features([a, a])["pixel_values"].shape == (8, 10)
    with pytest.raises(ValueError, match="dimensions"):
        stack_features([a, b])


def test_the_idefics3_family_is_registered_and_needs_its_special_tokens():
    pytest.importorskip("transformers")
    from agentloop_core.testing.tiny_tokenizer import load_tiny_tokenizer
    from agentloop_core.vision import Idefics3Processor

    assert "idefics3" in vision_families()
    with pytest.raises(ValueError, match="lacks the Idefics3 special token"):
        Idefics3Processor(None, load_tiny_tokenizer(), image_seq_len=4)
