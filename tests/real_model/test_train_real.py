"""(d) ``agentloop train``: two GRPO steps with LoRA on the real checkpoint (small sizes), the
built-in tool-aware template (through ``model.custom_chat_template`` for SmolLM2; Gemma's fetched
folder carries ``gemma-hermes`` as its own, so its run sets no template key), a checkpoint at step 2
whose Hugging Face folder transformers loads with the LoRA update merged into the base weights.

The reward is the parity of the response's length: the raw checkpoint almost never solves a
calculator problem (0/0 rewards give GRPO no signal), and this one gives every group a signal,
so a step must produce a gradient and move the adapters. Measured: ~15-25 s for the whole test
on SmolLM2; Gemma 3's timing is in docs/real-checkpoints.md. Nothing here claims the model learns.
"""

from __future__ import annotations

import json
import time

import pytest
from real_model_helpers import report

torch = pytest.importorskip("torch", reason="the trainer needs torch")
pytest.importorskip("peft", reason='LoRA needs pip install "agentloop-trainer[lora]"')

PARITY = ("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
          "    return float(len(solution_str) % 2)\n")


def template_keys(model_dir, real_model) -> list[str]:
    """``model.custom_chat_template=<the tool template>``, unless the folder's own template is it."""
    from real_model_helpers import tool_template_text

    own = model_dir / "chat_template.jinja"
    if own.is_file() and own.read_text(encoding="utf-8") == tool_template_text(real_model.tool_template):
        return []
    return [f"model.custom_chat_template={real_model.tool_template}"]


def test_two_grpo_steps_with_lora_export_a_loadable_folder(model_dir, real_model, tool_tokenizer, tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from agentloop_trainer.cli import main

    reward = tmp_path / "parity.py"
    reward.write_text(PARITY)
    run = tmp_path / "run"
    started = time.perf_counter()
    code = main([
        "train", f"model.path={model_dir}", *template_keys(model_dir, real_model),
        "actor_rollout_ref.model.lora_rank=8", "actor_rollout_ref.model.lora_alpha=16",
        "actor_rollout_ref.model.target_modules=[q_proj,v_proj]", "actor_rollout_ref.actor.lr=1e-3",
        "data.train_size=8", "data.val_size=2", "data.train_batch_size=2", "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.rollout.multi_turn.max_tokens_per_turn=16", "data.max_response_length=48",
        "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=2", f"custom_reward_function.path={reward}",
        "trainer.total_steps=2", "trainer.test_freq=0", "trainer.val_before_train=false", "trainer.save_freq=2",
        "trainer.progress_bar=false", f"trainer.run_dir={run}",
    ])
    assert code == 0
    report(f"{real_model.name}: agentloop train, 2 GRPO steps with LoRA and a checkpoint: "
           f"{time.perf_counter() - started:.1f} s")
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "actor/pg_loss" in r]
    assert [s["step"] for s in steps] == [1, 2]
    # A group whose two samples tie gives no signal; with this seed step 1's group does not.
    assert any(s["actor/grad_norm"] > 0 for s in steps), "the parity reward must give a gradient"
    report("train: " + "; ".join(f"step {s['step']}: reward {s['reward/mean']:.2f}, grad_norm {s['actor/grad_norm']:.3g}, "
                                 f"{s['rollout/generated_tokens']} generated tokens" for s in steps))
    assert json.loads((run / "summary.json").read_text())["steps"] == 2

    hf = run / "checkpoints" / "step_2" / "hf"
    exported = AutoModelForCausalLM.from_pretrained(str(hf), dtype=torch.float32)
    assert type(exported).__name__ == real_model.model_class
    assert not any("lora" in name for name in exported.state_dict()), "adapters must be merged, not saved"
    assert AutoTokenizer.from_pretrained(str(hf)).chat_template == tool_tokenizer.chat_template
    base = load_file(str(model_dir / "model.safetensors"))
    new = exported.state_dict()
    moved = [n for n in base if n.endswith(("q_proj.weight", "v_proj.weight")) and not torch.equal(base[n], new[n])]
    assert moved, "no q_proj/v_proj weight differs from the base: the LoRA update was not merged"
    untouched = [n for n in base if n.endswith(("k_proj.weight", "up_proj.weight")) and not torch.equal(base[n], new[n])]
    assert not untouched, f"weights outside target_modules changed: {untouched[:3]}"
    # It generates: greedy on a calculator prompt.
    prompt = tool_tokenizer.apply_chat_template([{"role": "user", "content": "What is 2 + 3?"}],
                                                add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = exported.generate(**prompt, max_new_tokens=4, do_sample=False)
    eos = exported.generation_config.eos_token_id
    assert out.shape[1] == prompt["input_ids"].shape[1] + 4 or int(out[0, -1]) in (eos if isinstance(eos, list) else [eos])
