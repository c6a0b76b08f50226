"""`agentloop train` on a vision-language model: verl's multimodal rows (``<image>`` markers and
an ``images`` column of encoded bytes) through the rollout, the update's forward with the
rollout's pixel values, weight sync into the engine, and an exported folder that keeps the
image processor. Two GRPO steps on the tiny Qwen2-VL, on one process and on two FSDP ranks,
with prompts with and without an image in one batch."""

from __future__ import annotations

import io
import json
import textwrap

import pytest

Image = pytest.importorskip("PIL.Image")

from agentloop_trainer.cli import main  # noqa: E402
from agentloop_trainer.data import write_parquet_rows  # noqa: E402

REWARD = textwrap.dedent('''
    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        # Varies across samples of a prompt so GRPO has a signal to follow.
        return float(len(solution_str) % 3) / 2.0
''')


def _png(level: int) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (56, 84), (25 * level, 200 - 15 * level, 40)).save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture
def vision_task(tmp_path):
    # Every other prompt has no image: a batch (and an FSDP rank's share of it) mixes both.
    rows = [{"data_source": "user/cards", "agent_name": "single_turn_agent",
             "prompt": [{"role": "system", "content": "Look at the card."},
                        {"role": "user", "content": ("<image>" if i % 2 == 0 else "") + "How bright is the card? "
                                                    "Answer #### N."}],
             "images": [{"bytes": _png(i % 10), "path": None}] if i % 2 == 0 else [],
             "reward_model": {"style": "rule", "ground_truth": str(i % 10)},
             "extra_info": {"index": i}} for i in range(6)]
    write_parquet_rows(rows[:4], tmp_path / "train.parquet")
    write_parquet_rows(rows[4:], tmp_path / "val.parquet")
    (tmp_path / "reward.py").write_text(REWARD)
    return tmp_path


@pytest.mark.slow
@pytest.mark.parametrize("fsdp_ranks", [1, 2])
def test_two_grpo_steps_on_a_vision_language_model(vision_task, tmp_path, fsdp_ranks):
    from agentloop_core.vision import load_vision_processor
    from agentloop_engines.testing.tiny_vlm import build_tiny_vlm

    model_path = build_tiny_vlm(initializer_range=0.3)
    out = tmp_path / "out"
    args = [f"model.path={model_path}", f"data.train_files={vision_task / 'train.parquet'}",
            f"data.val_files={vision_task / 'val.parquet'}", f"custom_reward_function.path={vision_task / 'reward.py'}",
            "data.train_batch_size=2", "actor_rollout_ref.rollout.n=4", "data.max_response_length=12",
            "data.max_prompt_length=300", "trainer.total_steps=2", "trainer.test_freq=0", "trainer.save_freq=2",
            "trainer.progress_bar=false", f"trainer.output_dir={out}", "trainer.experiment_name=vision",
            f"trainer.fsdp_ranks={fsdp_ranks}"]
    assert main(["train", *args]) == 0
    run = out / "vision"
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    train_steps = [s for s in steps if "actor/pg_loss" in s]
    assert [s["step"] for s in train_steps] == [1, 2]
    for s in train_steps:
        assert s["rollout/num_failed"] == 0
    # The update ran with a signal through the image rows (pixel values in the forward).
    assert any(s["actor/grad_norm"] > 0 for s in train_steps)
    # The exported folder is the same vision-language model: its image processor came along.
    hf = run / "checkpoints" / "step_2" / "hf"
    assert (hf / "preprocessor_config.json").is_file()
    from transformers import AutoTokenizer

    processor = load_vision_processor(hf, AutoTokenizer.from_pretrained(hf))
    assert processor is not None
    assert processor.process(Image.new("RGB", (112, 112))).num_tokens == 16
