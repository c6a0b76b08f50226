"""Overlong prompts with images: ``data.filter_overlong_prompts`` measures an image row as the
rollout renders it (each image as its run of image tokens, from the model's vision processor),
so a prompt the filter keeps is one the rollout can render within ``data.max_prompt_length``.
On the tiny vision-language models (Qwen2-VL and the tiled Idefics3)."""

from __future__ import annotations

import asyncio
import io

import pytest

pytest.importorskip("torch", reason="the tiny VLM needs torch (pip install \"agentloop-engines[hf]\")")
tiny_vlm = pytest.importorskip("agentloop_engines.testing.tiny_vlm", reason="agentloop-engines is not installed")

from agentloop_core.testing.vision_engines import VisionScriptedServer, gradient_picture  # noqa: E402
from agentloop_core.tokenization import ChatRenderer, Trajectory  # noqa: E402
from agentloop_core.vision import load_vision_processor  # noqa: E402
from agentloop_trainer.data import limit_prompt_length, prompt_lengths, read_parquet_rows, write_parquet_rows  # noqa: E402
from agentloop_trainer.task import tool_schemas  # noqa: E402


def _png(size: tuple[int, int], seed: int = 0) -> bytes:
    buf = io.BytesIO()
    gradient_picture(size, seed).save(buf, "PNG")
    return buf.getvalue()


def _row(i: int, text: str, images: list[bytes]) -> dict:
    return {"data_source": "user/look", "agent_name": "tool_agent",
            "prompt": [{"role": "user", "content": "<image>" * len(images) + text}],
            "images": [{"bytes": b, "path": None} for b in images],
            "reward_model": {"style": "rule", "ground_truth": "1"}, "extra_info": {"index": i}}


def _vlm(family: str):
    import transformers

    folder = tiny_vlm.build_tiny_vlm(family=family)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(folder))
    processor = load_vision_processor(folder, tokenizer)
    assert processor is not None
    return tokenizer, processor


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    """verl-layout rows as the trainer reads them: a large image, two small ones, text only."""
    path = tmp_path_factory.mktemp("rows") / "train.parquet"
    write_parquet_rows([_row(0, "What is shown?", [_png((448, 448))]),
                        _row(1, "Compare them.", [_png((56, 56), 1), _png((84, 56), 2)]),
                        _row(2, "What is 2 + 2?", [])], path)
    return read_parquet_rows(path)


@pytest.mark.parametrize("family", ["qwen2_vl", "idefics3"])
@pytest.mark.parametrize("with_tools", [False, True])
def test_image_prompts_are_measured_as_the_rollout_renders_them(rows, family, with_tools):
    tokenizer, processor = _vlm(family)
    tools = tool_schemas() if with_tools else None
    renderer = ChatRenderer(tokenizer, tools=tools, vision=processor)
    rendered = [len(Trajectory(renderer, row["prompt"]).prompt_ids) for row in rows]

    assert prompt_lengths(rows, tokenizer, tools) == rendered
    assert rendered[0] - rendered[2] > 30  # the large image is many tokens, not one placeholder


def test_an_overlong_image_prompt_is_dropped_and_a_kept_one_renders_within_the_limit(rows):
    from agentloop_tools.agent_loop import ToolAgentLoop

    tokenizer, processor = _vlm("qwen2_vl")
    lengths = prompt_lengths(rows, tokenizer, None)
    limit = sorted(lengths)[-2]  # every prompt but the large image's fits
    kept, dropped = limit_prompt_length(rows, tokenizer, None, limit, filter_overlong=True)
    assert ([r["extra_info"]["index"] for r in kept], dropped) == ([1, 2], 1)
    with pytest.raises(ValueError, match=rf"row 0 \({lengths[0]} tokens\).*filter_overlong_prompts=true"):
        limit_prompt_length(rows, tokenizer, None, limit, filter_overlong=False)

    # The rollout (its prompt_length is data.max_prompt_length) renders each kept row.
    for row in kept:
        server = VisionScriptedServer(tokenizer, ["done"], processor.image_token_id)
        loop = ToolAgentLoop(server, tokenizer, {"tools": {}, "prompt_length": limit, "response_length": 64},
                             processor=processor)
        out = asyncio.run(loop.run({"temperature": 0.0}, raw_prompt=row["prompt"]))
        assert len(out.prompt_ids) <= limit


def test_an_unreadable_image_is_named_not_counted_as_one_token(rows):
    tokenizer, _ = _vlm("qwen2_vl")
    broken = [rows[2], {**rows[0], "prompt": [{"role": "user", "content": [
        {"type": "image", "image": {"bytes": b"\x89PNG\r\n\x1a\nxx"}}, {"type": "text", "text": "?"}]}]}]
    with pytest.raises(ValueError, match=r"train: 1 prompts' images cannot be rendered: row 1: .*not a readable image"
                                         r".*the rollout would fail"):
        limit_prompt_length(broken, tokenizer, None, 4096, filter_overlong=True, name="train")


def test_an_image_over_a_limit_a_loop_may_raise_keeps_its_row_with_a_warning(rows, caplog):
    """``max_image_pixels`` and the like are a loop's settings (``rollout.agent.loops.<name>``),
    not the loader's: a row over the default limits is kept, measured as its template writes it."""
    from agentloop_core.vision import ImageLimits

    tokenizer, processor = _vlm("qwen2_vl")
    strict = ImageLimits(max_pixels=100 * 100)  # row 0's 448 x 448 image is over it, row 1's are not
    with caplog.at_level("WARNING"):
        kept, dropped = limit_prompt_length(rows, tokenizer, None, 4096, filter_overlong=True, name="train",
                                            processor=processor, image_limits=strict)
    assert (len(kept), dropped) == (3, 0)
    assert "train: 1 prompts' images are over the default image limits" in caplog.text
    assert "row 0:" in caplog.text
    assert "max_image_pixels" in caplog.text
    lengths = prompt_lengths(rows, tokenizer, None, processor, image_limits=strict)
    templated = tokenizer.apply_chat_template(list(rows[0]["prompt"]), tokenize=True, add_generation_prompt=True)
    assert lengths[0] == len(templated["input_ids"] if hasattr(templated, "keys") else templated)


def test_images_for_a_text_only_model_name_the_fix(rows, tokenizer):
    with pytest.raises(ValueError, match=r"2 prompts have images \(row 0, row 1\), but .* has no vision processor.*vision-language"):
        prompt_lengths(rows, tokenizer, None)
    assert len(prompt_lengths(rows[2:], tokenizer, None)) == 1  # text rows are measured as before


def test_the_run_drops_an_overlong_image_prompt_with_the_models_own_processor(tmp_path):
    """Through the trainer's loading (``run_records``): the tokenizer from ``model.path``, the
    vision processor from the same folder, as the rollout loads it."""
    from agentloop_trainer.config import load_config
    from agentloop_trainer.policy.tokenizer import load_tokenizer
    from agentloop_trainer.stages.rollout_setup import run_records

    folder = tiny_vlm.build_tiny_vlm()
    train = write_parquet_rows([_row(0, "What is shown?", [_png((448, 448))]), _row(1, "And here?", [_png((56, 56))])],
                               tmp_path / "train.parquet")
    val = write_parquet_rows([_row(2, "Look.", [_png((56, 56))])], tmp_path / "val.parquet")
    cfg = load_config([f"model.path={folder}", f"data.train_files={train}", f"data.val_files={val}",
                       "data.max_prompt_length=64", "reward.source=loop"])
    stats: dict[str, int] = {}
    kept, held = run_records(cfg, load_tokenizer(cfg.model), None, stats)
    assert [r["extra_info"]["index"] for r in kept] == [1]
    assert [r["extra_info"]["index"] for r in held] == [2]
    assert stats == {"data/dropped_overlong_train": 1, "data/dropped_overlong_val": 0}
