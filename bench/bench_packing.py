"""Padded vs packed (padding-free) updates: tokens per second of the log-prob pass plus the
update pass on a tool-agent-like batch of mixed lengths (issue 49, item 2).

The batch: ``--rows`` trajectories whose lengths are drawn like a tool-agent batch, many short
and a few long (70% in 64..192 tokens, 20% in 192..512, 10% up to ``--max-len``; seeded), each
a prompt (a third of the sequence, at most 128 tokens) and a multi-turn response whose middle
third is a tool result (``response_mask`` 0 there). Random ids, random advantages.

One measured step is what the trainer runs per batch with ``ppo_epochs=1`` and recomputed old
log-probs: ``actor.compute_log_probs(pb)`` (no grad) then ``actor.update(pb, adv, old)`` (forward,
backward, AdamW step). Modes, all with the config's defaults otherwise (no
``ppo_micro_batch_size_per_gpu``: a whole batch per pass when padded):

- ``padded``: ``use_remove_padding=false``; one pass over all rows padded to the longest (and
  the rows' common prefix computed once).
- ``padded+dynamic_bsz``: ``use_remove_padding=false use_dynamic_bsz=true``, padded micro-batches
  of similar lengths within ``ppo_max_token_len_per_gpu`` (rows x longest).
- ``packed``: ``use_remove_padding=true`` (the default): packed rows of at most
  ``ppo_max_token_len_per_gpu`` tokens (default 16384), attention per sequence.

Tokens/s counts the batch's real tokens (no padding) once per step. Each repeat runs every mode
once, in turn, on a fresh copy of the same weights; the table gives the median over repeats.
Models: the tiny Qwen2 policy (``build_tiny_policy``, hidden 96 since 2026-12-05, 128 before; 2 layers) and, when the
converted SmolLM2-135M is in ``~/.cache/agentloop/pretrained`` (``agentloop model list``), that
too (smaller batch: ``--smol-rows``, ``--smol-max-len``). One thread (``OMP_NUM_THREADS=1``): the
machine is shared; the load average is recorded.

    python bench/bench_packing.py [--repeats 3] [--rows 32] [--skip-smollm2]
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import load_average, table, versions, write_result  # noqa: E402

MODES: dict[str, dict[str, Any]] = {
    "padded": {"use_remove_padding": False},
    "padded+dynamic_bsz": {"use_remove_padding": False, "use_dynamic_bsz": True},
    "packed": {"use_remove_padding": True},
}


def draw_lengths(rows: int, max_len: int, seed: int = 0) -> list[int]:
    """Tool-agent-like lengths: many short, a few long."""
    import random

    rng = random.Random(seed)
    out = []
    for _ in range(rows):
        u = rng.random()
        lo, hi = (64, 192) if u < 0.7 else (192, 512) if u < 0.9 else (512, max_len)
        out.append(rng.randint(lo, max(lo, min(hi, max_len))))
    return out


def make_batch(vocab: int, lengths: list[int], seed: int = 0):
    import torch

    from agentloop_trainer.update import PolicyBatch

    g = torch.Generator().manual_seed(seed)
    seqs, plens = [], []
    R = max(n - min(128, n // 3) for n in lengths)
    mask = torch.zeros(len(lengths), R)
    for b, n in enumerate(lengths):
        p = min(128, n // 3)
        seqs.append(torch.randint(0, vocab, (n,), generator=g).tolist())
        plens.append(p)
        r = n - p
        mask[b, :r] = 1.0
        mask[b, r // 3 : 2 * r // 3] = 0.0  # a tool result between two assistant turns
    return PolicyBatch(seqs, plens, mask, None), torch.randn(len(lengths), generator=g)


def one_step(model, mode: str, pb, adv) -> tuple[float, float]:
    """Seconds of (log-prob pass, update pass) of one step in ``mode``."""
    from agentloop_trainer.update import ActorConfig, PolicyGradientActor

    actor = PolicyGradientActor(model, ActorConfig(lr=1e-5, tis_cap=None, **MODES[mode]))
    start = time.perf_counter()
    old = actor.compute_log_probs(pb)
    mid = time.perf_counter()
    actor.update(pb, adv, old)
    return mid - start, time.perf_counter() - mid


def bench_model(name: str, model, lengths: list[int], repeats: int) -> dict:
    pb, adv = make_batch(model.config.vocab_size, lengths)
    tokens = sum(lengths)
    print(f"{name}: {len(lengths)} rows, {tokens} tokens (padded to the longest: {len(lengths) * max(lengths)})",
          flush=True)
    one_step(copy.deepcopy(model), "packed", pb, adv)  # warm-up (allocator, first-call setup)
    runs: dict[str, list[tuple[float, float]]] = {m: [] for m in MODES}
    for rep in range(repeats):
        for mode in MODES:
            runs[mode].append(one_step(copy.deepcopy(model), mode, pb, adv))
            lp, up = runs[mode][-1]
            print(f"  repeat {rep + 1} {mode}: log-probs {lp:.2f}s, update {up:.2f}s", flush=True)
    out = {"rows": len(lengths), "tokens": tokens, "longest": max(lengths), "lengths": lengths, "modes": {}}
    for mode, times in runs.items():
        total = statistics.median(a + b for a, b in times)
        out["modes"][mode] = {
            "log_prob_s": [a for a, _ in times], "update_s": [b for _, b in times],
            "median_step_s": total, "median_log_prob_s": statistics.median(a for a, _ in times),
            "median_update_s": statistics.median(b for _, b in times), "tokens_per_s": tokens / total,
        }
    base = out["modes"]["padded"]["tokens_per_s"]
    for mode in MODES:
        out["modes"][mode]["speedup_vs_padded"] = out["modes"][mode]["tokens_per_s"] / base
    return out


def smollm2_path() -> Path | None:
    """The converted SmolLM2 folder in the pretrained cache, if any (a Llama with 30 layers)."""
    root = Path.home() / ".cache" / "agentloop" / "pretrained"
    for config in sorted(root.glob("*/config.json")):
        data = json.loads(config.read_text())
        if data.get("model_type") == "llama" and data.get("num_hidden_layers") == 30:
            return config.parent
    return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--max-len", type=int, default=1024)
    ap.add_argument("--smol-rows", type=int, default=8)
    ap.add_argument("--smol-max-len", type=int, default=512)
    ap.add_argument("--skip-smollm2", action="store_true")
    args = ap.parse_args()

    import torch

    from agentloop_core.testing import load_tiny_tokenizer
    from agentloop_trainer.policy import build_tiny_policy

    torch.set_num_threads(1)
    start_load = load_average()
    results = {}
    tiny = build_tiny_policy(load_tiny_tokenizer(), seed=0)
    results["tiny-qwen2"] = bench_model("tiny-qwen2", tiny, draw_lengths(args.rows, args.max_len), args.repeats)
    path = None if args.skip_smollm2 else smollm2_path()
    if path is not None:
        from transformers import AutoModelForCausalLM

        smol = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
        results["smollm2-135m"] = bench_model("smollm2-135m", smol, draw_lengths(args.smol_rows, args.smol_max_len, 1),
                                              args.repeats)
    rows = []
    for model, r in results.items():
        for mode, m in r["modes"].items():
            rows.append([model, mode, r["rows"], r["tokens"], m["median_log_prob_s"], m["median_update_s"],
                         m["median_step_s"], m["tokens_per_s"], f"{m['speedup_vs_padded']:.2f}x"])
    text = table(["model", "mode", "rows", "tokens", "log-probs s", "update s", "step s", "tokens/s", "vs padded"],
                 rows, title=f"padded vs packed updates (median of {args.repeats}; load {start_load} at start)")
    write_result("packing", {
        "description": __doc__, "load_average_at_start": start_load, "repeats": args.repeats,
        "versions": versions("torch", "transformers"), "smollm2_path": str(path) if path else None,
        "results": results, "table": text,
    })


if __name__ == "__main__":
    main()
