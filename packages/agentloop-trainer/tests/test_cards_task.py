"""The built-in vision task (cards): its tool, rows, demonstrations and scorer, and SFT on
conversations whose tool results are pictures (the image tokens carry no loss)."""

from __future__ import annotations

import asyncio
import json

import pytest

pytest.importorskip("PIL")

from agentloop_trainer.cli import main  # noqa: E402
from agentloop_trainer.reward.scoring import builtin_scorer  # noqa: E402
from agentloop_trainer.task.cards import (  # noqa: E402
    BIASED,
    DATA_SOURCE,
    NAMES,
    ShowCardTool,
    card_demonstrations,
    card_picture,
    card_rows,
)


def test_the_tool_shows_the_rows_card_and_refuses_an_unknown_colour():
    tool = ShowCardTool({})
    row = card_rows(1, 3)[0]

    async def show():
        iid = await tool.create(**row["extra_info"]["tools_kwargs"]["show_card"])
        response, reward, _ = await tool.execute(iid, {})
        return response, reward

    response, reward = asyncio.run(show())
    kwargs = row["extra_info"]["tools_kwargs"]["show_card"]["create_kwargs"]
    assert response.image[0].tobytes() == card_picture(kwargs["colour"], kwargs["seed"]).tobytes()
    assert reward == 0.0
    with pytest.raises(ValueError, match="colour 'mauve' is not one of red"):
        asyncio.run(tool.create(create_kwargs={"colour": "mauve", "seed": 1}))


def test_pictures_of_one_colour_differ_and_prompts_never_name_it():
    assert card_picture("red", 1).tobytes() != card_picture("red", 2).tobytes()
    for row in card_rows(50, 0):
        text = json.dumps(row["prompt"])
        assert not any(name in text for name in NAMES)


def test_the_teacher_is_biased_on_three_colours_only():
    rows = card_demonstrations(600, 0, flip_prob=0.6)
    wrong = {name: [0, 0] for name in NAMES}
    for row in rows:
        colour, said = row["extra_info"]["colour"], row["messages"][-1]["content"].split()[-1]
        wrong[colour][0] += said != colour
        wrong[colour][1] += 1
    for name, (bad, n) in wrong.items():
        rate = bad / n
        assert (0.4 < rate < 0.8) if name in BIASED else rate == 0.0, (name, rate)


def test_the_word_scorer_reads_the_last_answer():
    score = builtin_scorer(DATA_SOURCE, None)
    assert score is not None
    assert score(DATA_SOURCE, "I see it.\n#### Red.", "red", {}) == 1.0
    assert score(DATA_SOURCE, "#### red then #### blue", "red", {}) == 0.0
    assert score(DATA_SOURCE, "red", "red", {}) == 0.0


def test_sft_on_demonstrations_with_pictures_trains_no_image_token():
    from transformers import AutoTokenizer

    from agentloop_core.vision import load_vision_processor
    from agentloop_engines.testing.tiny_vlm import build_tiny_vlm
    from agentloop_trainer.stages.sft.data import parse_row
    from agentloop_trainer.stages.sft.tokenize import SFTTokenizer

    folder = build_tiny_vlm()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    processor = load_vision_processor(folder, tokenizer)
    sft = SFTTokenizer(tokenizer, vision=processor)
    example = parse_row(card_demonstrations(1, 5)[0])
    tc = sft.tokenize(example.messages, example.tools, check=True)
    assert len(tc.images) == 1
    pad = processor.image_token_id
    assert tc.input_ids.count(pad) == tc.images[0].num_tokens == 4
    assert all(m == 0 for t, m in zip(tc.input_ids, tc.loss_mask, strict=True) if t == pad)
    assert tc.trained_tokens > 0


def test_agentloop_data_cards_writes_the_task(tmp_path):
    assert main(["data", "cards", "--out", str(tmp_path), "--n-train", "8", "--n-val", "4", "--n-sft", "6"]) == 0
    for name in ("train.parquet", "val.parquet", "sft.jsonl", "tools.yaml"):
        assert (tmp_path / name).is_file(), name
    assert len((tmp_path / "sft.jsonl").read_text().splitlines()) == 6


@pytest.mark.slow
def test_the_vision_job_runs_as_configured_for_two_steps(tmp_path):
    """examples/trainer/tiny_vlm_cards.yaml (`nox -s train-vision`) with its steps cut: SFT with
    pictures, then GRPO whose tool returns pictures, and the eval line of the main job."""
    from pathlib import Path

    from agentloop_engines.testing.tiny_vlm import build_tiny_vlm

    data = tmp_path / "cards"
    assert main(["data", "cards", "--out", str(data), "--n-train", "16", "--n-val", "4", "--n-sft", "32"]) == 0
    config = Path(__file__).resolve().parents[3] / "examples" / "trainer" / "tiny_vlm_cards.yaml"
    out = tmp_path / "out"
    assert main(["train", "--config", str(config), f"model.path={build_tiny_vlm()}",
                 f"sft.train_files={data / 'sft.jsonl'}", f"data.train_files={data / 'train.parquet'}",
                 f"data.val_files={data / 'val.parquet'}",
                 f"actor_rollout_ref.rollout.multi_turn.tool_config_path={data / 'tools.yaml'}",
                 "sft.total_steps=4", "sft.warmup_steps=1", "sft.batch_size=8", "data.train_batch_size=2",
                 "actor_rollout_ref.rollout.n=2", "trainer.total_steps=2", "trainer.test_freq=0",
                 "trainer.progress_bar=false", f"trainer.output_dir={out}", "trainer.experiment_name=cards"]) == 0
    run = out / "cards"
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    train_steps = [s for s in steps if "actor/pg_loss" in s]
    assert [s["step"] for s in train_steps] == [1, 2]
    assert all(s["rollout/num_failed"] == 0 for s in train_steps)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["held_out_size"] == 4
    assert (run / "sft" / "hf" / "preprocessor_config.json").is_file()
