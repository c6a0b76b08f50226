"""Benchmark 5: GRPO step throughput: ours on 1 process and on 2 FSDP2 ranks, and TRL.

Same tiny random Qwen2 (``build_tiny_model()``, 2 layers, hidden 128), same 8 prompts, group
size 4, at most 32 new tokens, temperature 1, the same toy reward (share of digits in the
completion). SINGLE-TURN on both sides: TRL's tool mode only parses tool calls for chat
templates it recognises byte for byte, so a multi-turn tool comparison on our tiny ChatML
tokenizer would not be like for like.

* ``ours, 1 process``: HFServer generates the 32 completions (batched; each distinct prompt
  prefilled once), then ``PolicyGradientActor.update`` (group-normalised advantages, PPO clip, one
  optimizer step per batch, so the update's own forward is the old policy as in the trainer's
  step and in TRL with ``num_iterations=1``; each distinct prompt runs once in that forward)
  and a weight sync back into HFServer.
* ``ours update only, 1 process`` vs ``2 FSDP2 ranks (gloo)``: the update phase alone
  (``compute_log_probs`` + ``update``) on a fixed batch of 32 random sequences (prompt 40 +
  response 32 tokens, no prompt repeated), through
  ``agentloop_trainer.update.fsdp.spawn``; on 2 shared cores FSDP mostly adds communication.
* ``TRL GRPOTrainer``: ``GRPOConfig(use_cpu=True, use_vllm=False)``, transformers
  generation; a callback times each optimizer step.

Tokens/s = completion (response) tokens processed per second of step time, after a warm-up step.
Ours and TRL run in alternating rounds (``--rounds``, fresh model and warm-up each) and their
steps are pooled, so a load swing on the shared machine hits both sides alike.

With ``--model PATH`` (a real checkpoint's folder with its tokenizer, or a name ``agentloop model
fetch`` knows, e.g. ``smollm2-135m-instruct``) every run uses that model instead, and the update-only rows
also report the achieved FLOP/s (8 x parameters x tokens per update: the no-grad old-policy
forward and the forward + backward, attention left out) against this machine's measured fp32
matmul peak on one thread (2048 x 2048).

Run: ``python bench/bench_trainer.py`` (writes ``bench/results/trainer.json``; with ``--model``,
``bench/results/trainer_real.json``).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import load_average, matmul_peaks_gflops, table, versions, write_result  # noqa: E402

PROMPTS = 8
GROUP = 4
MAX_NEW = 32
STEPS = 5
ROUNDS = 2
GOAL_VS_TRL = 1.3
MODEL_PATH: str | None = None
"""A real checkpoint's folder (``--model``); None: the built-in tiny model."""
CPU_MATMUL = os.environ.get("AGENTLOOP_BENCH_CPU_MATMUL", "onednn")
"""Our side's ``model.cpu_matmul`` (``--cpu-matmul``; in the environment for the FSDP2 ranks)."""


def model_and_tokenizer() -> tuple[str, object]:
    """The model folder and its tokenizer: ``MODEL_PATH``'s, or the built-in tiny pair."""
    if MODEL_PATH:
        from transformers import AutoTokenizer

        return MODEL_PATH, AutoTokenizer.from_pretrained(MODEL_PATH)
    from agentloop_core.testing.tiny_tokenizer import load_tiny_tokenizer
    from agentloop_engines import build_tiny_model

    return str(build_tiny_model()), load_tiny_tokenizer()


def questions() -> list[list[dict]]:
    return [[{"role": "user", "content": f"What is {a} + {b}? Answer with a number."}]
            for a, b in zip(range(3, 3 + PROMPTS), range(11, 11 + PROMPTS), strict=True)]


def digit_reward(text: str) -> float:
    return sum(c.isdigit() for c in text) / max(1, len(text))


async def ours_full_steps() -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from agentloop_engines import HFServer
    from agentloop_trainer.update import ActorConfig, PolicyBatch, PolicyGradientActor, group_advantages

    path, tok = model_and_tokenizer()
    from agentloop_trainer.policy.model import use_cpu_matmul

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    use_cpu_matmul(model, CPU_MATMUL, "cpu")  # as build_trainer does with model.cpu_matmul
    server = HFServer(path, tok, max_batch_size=PROMPTS * GROUP)
    actor = PolicyGradientActor(model, ActorConfig(lr=1e-4))
    prompts = [tok.apply_chat_template(q, add_generation_prompt=True, tokenize=False) for q in questions()]
    prompt_ids = [tok.encode(p, add_special_tokens=False) for p in prompts]
    times, tokens = [], []
    for step in range(STEPS + 1):
        start = time.perf_counter()
        outs = await asyncio.gather(*(
            server.generate(f"s{step}-{i}-{g}", prompt_ids[i], {"max_tokens": MAX_NEW, "temperature": 1.0,
                                                                 "top_k": -1, "logprobs": True})
            for i in range(PROMPTS) for g in range(GROUP)))
        rewards = torch.tensor([digit_reward(tok.decode(o.token_ids)) for o in outs])
        groups = [i for i in range(PROMPTS) for _ in range(GROUP)]
        adv = group_advantages(rewards, groups)
        width = max(len(o.token_ids) for o in outs)
        mask = torch.zeros(len(outs), width)
        rollout = torch.zeros(len(outs), width)
        seqs, plens = [], []
        for b, (o, i) in enumerate(zip(outs, groups, strict=True)):
            seqs.append(prompt_ids[i] + list(o.token_ids))
            plens.append(len(prompt_ids[i]))
            mask[b, : len(o.token_ids)] = 1
            rollout[b, : len(o.token_ids)] = torch.tensor(o.log_probs)
        pb = PolicyBatch(seqs, plens, mask, rollout)
        # As the trainer's step does (and TRL with num_iterations=1): one optimizer step per
        # batch, so the update's own forward, detached, is the old policy.
        actor.update(pb, adv, None)
        await server.update_weights([(k, v.detach()) for k, v in model.state_dict().items()])
        if step:  # step 0 is the warm-up
            times.append(time.perf_counter() - start)
            tokens.append(int(mask.sum()))
    await server.close()
    return {"step_s": times, "completion_tokens": tokens,
            "tokens_per_s": sum(tokens) / sum(times), "median_step_s": statistics.median(times)}


def _update_batch(vocab: int):
    import torch

    from agentloop_trainer.update import PolicyBatch

    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, vocab, (40 + MAX_NEW,), generator=g).tolist() for _ in range(PROMPTS * GROUP)]
    mask = torch.ones(len(seqs), MAX_NEW)
    adv = torch.randn(len(seqs), generator=g)
    return PolicyBatch(seqs, [40] * len(seqs), mask, None), adv


def _update_steps(model) -> list[float]:
    import torch

    from agentloop_trainer.update import ActorConfig, PolicyGradientActor

    torch.set_num_threads(1)
    actor = PolicyGradientActor(model, ActorConfig(lr=1e-4, tis_cap=None))
    pb, adv = _update_batch(model.config.vocab_size)
    times = []
    for step in range(STEPS + 1):
        start = time.perf_counter()
        old = actor.compute_log_probs(pb)
        actor.update(pb, adv, old)
        if step:
            times.append(time.perf_counter() - start)
    return times


def _fsdp_rank(rank: int, model_path: str) -> list[float]:
    from transformers import AutoModelForCausalLM

    from agentloop_trainer.policy.model import use_cpu_matmul
    from agentloop_trainer.update import shard_policy

    model = AutoModelForCausalLM.from_pretrained(model_path)
    use_cpu_matmul(model, CPU_MATMUL, "cpu")  # as build_trainer does with model.cpu_matmul
    return _update_steps(shard_policy(model))


def ours_update_only() -> dict:
    from transformers import AutoModelForCausalLM

    from agentloop_trainer.update import spawn

    path, _ = model_and_tokenizer()
    tokens = PROMPTS * GROUP * MAX_NEW
    from agentloop_trainer.policy.model import use_cpu_matmul

    model = AutoModelForCausalLM.from_pretrained(path)
    use_cpu_matmul(model, CPU_MATMUL, "cpu")  # as build_trainer does with model.cpu_matmul
    params = sum(p.numel() for p in model.parameters())
    # Every position of every sequence goes through the old-policy forward (2 FLOPs per
    # parameter) and the update's forward + backward (6).
    flops = 8 * params * PROMPTS * GROUP * (40 + MAX_NEW)
    single = _update_steps(model)
    del model
    sharded = spawn(_fsdp_rank, 2, path)

    def row(times: list[float]) -> dict:
        step = sum(times) / len(times)
        return {"step_s": times, "tokens_per_s": tokens / step, "gflops_per_s": flops / step / 1e9}

    return {"tokens_per_update": tokens, "parameters": params, "flops_per_update": flops,
            "1 process": row(single), "2 FSDP2 ranks (gloo)": row(sharded)}


def trl_steps() -> dict:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    torch.set_num_threads(1)
    path, tok = model_and_tokenizer()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)

    def reward(completions, **_):
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return [digit_reward(t) for t in texts]

    class StepTimer(TrainerCallback):
        def __init__(self) -> None:
            self.times: list[float] = []
            self._t = 0.0

        def on_step_begin(self, args, state, control, **kw):
            self._t = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            self.times.append(time.perf_counter() - self._t)

    import tempfile

    timer = StepTimer()
    with tempfile.TemporaryDirectory() as out:
        cfg = GRPOConfig(output_dir=out, use_cpu=True, use_vllm=False, bf16=False, report_to="none",
                         per_device_train_batch_size=PROMPTS * GROUP, num_generations=GROUP,
                         max_completion_length=MAX_NEW, temperature=1.0, top_k=0, top_p=1.0,
                         learning_rate=1e-4, max_steps=STEPS + 1, logging_steps=1, save_strategy="no",
                         dataloader_num_workers=0, seed=0, disable_tqdm=True)
        data = Dataset.from_dict({"prompt": questions() * 4})
        trainer = GRPOTrainer(model=model, reward_funcs=reward, args=cfg, train_dataset=data,
                              processing_class=tok, callbacks=[timer])
        trainer.train()
        logs = [h for h in trainer.state.log_history if "completions/mean_length" in h]
    lengths = [h["completions/mean_length"] * PROMPTS * GROUP for h in logs]
    times = timer.times[1:]
    tokens = lengths[1 : 1 + len(times)]
    return {"step_s": times, "completion_tokens": tokens, "tokens_per_s": sum(tokens) / sum(times),
            "median_step_s": statistics.median(times), "config": "GRPOConfig(use_cpu=True, use_vllm=False, "
            f"per_device_train_batch_size={PROMPTS * GROUP}, num_generations={GROUP}, "
            f"max_completion_length={MAX_NEW}, temperature=1.0, top_k=0)"}


def _pooled(runs: list[dict]) -> dict:
    """One result from several rounds of the same run: all their timed steps together."""
    times = [t for r in runs for t in r["step_s"]]
    tokens = [n for r in runs for n in r["completion_tokens"]]
    return {**runs[0], "step_s": times, "completion_tokens": tokens, "tokens_per_s": sum(tokens) / sum(times),
            "median_step_s": statistics.median(times), "rounds": len(runs)}


def main() -> None:
    global STEPS, MODEL_PATH, CPU_MATMUL
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--skip-trl", action="store_true")
    parser.add_argument("--model", help="a real checkpoint's folder, or a name `agentloop model fetch` knows "
                                        "(smollm2-135m-instruct); default: the built-in tiny model")
    parser.add_argument("--skip-fsdp", action="store_true")
    parser.add_argument("--cpu-matmul", choices=["onednn", "torch"], default=CPU_MATMUL,
                        help="our side's model.cpu_matmul (torch: MKL's sgemm, as before #35)")
    parser.add_argument("--steps", type=int, default=STEPS, help="timed steps per run, after one warm-up")
    parser.add_argument("--no-write", action="store_true", help="print the table, keep results/trainer.json")
    parser.add_argument("--rounds", type=int, default=ROUNDS,
                        help="alternate ours and TRL this many times (load on a shared machine drifts)")
    args = parser.parse_args()
    STEPS = args.steps
    CPU_MATMUL = os.environ["AGENTLOOP_BENCH_CPU_MATMUL"] = args.cpu_matmul
    MODEL_PATH = args.model
    if MODEL_PATH and not Path(MODEL_PATH).is_dir():  # a name `agentloop model fetch` knows
        from agentloop_trainer.pretrained import fetch_model

        MODEL_PATH = str(fetch_model(MODEL_PATH))
    import torch

    torch.set_num_threads(1)
    peaks = matmul_peaks_gflops()
    peak = max(peaks.values())
    print(f"fp32 matmul peak, 1 thread: {peak:.1f} GFLOP/s ({peaks})", flush=True)
    load_start = load_average()
    results, notes = {}, {}
    full, trl = [], []
    for _ in range(args.rounds):
        full.append(asyncio.run(ours_full_steps()))
        print(f"  ours full step: {full[-1]['tokens_per_s']:.0f} tok/s", flush=True)
        if args.skip_trl or "trl" in notes:
            continue
        try:
            trl.append(trl_steps())
            print(f"  TRL full step: {trl[-1]['tokens_per_s']:.0f} tok/s", flush=True)
        except ImportError as exc:
            notes["trl"] = f"TRL not importable ({exc}); `pip install trl==1.16.0 torch==2.13.0` in the bench venv"
        except Exception as exc:  # noqa: BLE001
            notes["trl"] = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()[-1500:]}"
    results["ours full step, 1 process"] = _pooled(full)
    if not args.skip_fsdp:
        try:
            upd = ours_update_only()
            results["ours update only, 1 process"] = upd["1 process"]
            results["ours update only, 2 FSDP2 ranks"] = upd["2 FSDP2 ranks (gloo)"]
            share = upd["1 process"]["gflops_per_s"] / peak
            notes["flops"] = (f"update only, 1 process: {upd['1 process']['gflops_per_s']:.1f} GFLOP/s = "
                              f"{100 * share:.0f}% of the {peak:.1f} GFLOP/s fp32 matmul peak (1 thread, the larger of "
                              f"torch.mm and oneDNN; model.cpu_matmul={CPU_MATMUL}; "
                              f"{upd['parameters'] / 1e6:.1f}M parameters, 8 x params x tokens per update)")
        except Exception as exc:  # noqa: BLE001 - record why, keep the other numbers
            notes["fsdp"] = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()[-1200:]}"
    if trl:
        results["TRL GRPOTrainer full step"] = _pooled(trl)
        ratio = results["ours full step, 1 process"]["tokens_per_s"] / results["TRL GRPOTrainer full step"]["tokens_per_s"]
        verdict = "met" if ratio >= GOAL_VS_TRL else "missed"
        notes["goal"] = f"ours / TRL full-step tokens/s = {ratio:.2f} (goal >= {GOAL_VS_TRL}): {verdict}"
        print(notes["goal"])
    rows = [(name, round(r["tokens_per_s"]), round(statistics.median(r["step_s"]), 3)) for name, r in results.items()]
    for key, note in notes.items():
        if key not in ("goal", "flops"):
            rows.append((key, "n/a", note.splitlines()[0][:80]))
        print(f"{key}: {note}")
    text = table(["run", "tokens/s", "median step s"], rows,
                 title=f"GRPO step throughput (single-turn), {PROMPTS} prompts x {GROUP} samples, "
                       f"<= {MAX_NEW} new tokens, {MODEL_PATH or 'tiny model'}, 1 thread per process")
    if args.no_write:
        return
    write_result("trainer_real" if MODEL_PATH else "trainer", {
                             "description": __doc__.split("Run:")[0].strip(), "load_average_at_start": load_start,
                             "model": MODEL_PATH or "tiny", "matmul_peak_gflops_1_thread": peak,
                             "matmul_peaks_gflops_1_thread": peaks, "cpu_matmul": CPU_MATMUL,
                             "versions": versions("torch", "transformers", "trl"), "results": results,
                             "notes": notes, "table_markdown": text})


if __name__ == "__main__":
    main()
