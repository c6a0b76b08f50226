"""One long tail in a GRPO batch: a single prompt-shared padded pass against the tail-bucketed
micro-batches (``update/tail_buckets.py``, issue 49 item 4).

The batch has the main job's shape: ``--prompts`` prompts x ``--samples`` samples, every prompt a
324-token common prefix (the system turn and tool schema) and a ~36-token question of its own,
every answer 41..51 tokens; ``--outliers`` samples ramble to 200..250 tokens, as an untrained
policy's runaway calls do (the main job's update took 4-9 s on such steps against 0.9 s without
one). Random ids, random advantages.

One measured step is what the trainer runs per batch with recomputed old log-probs:
``actor.compute_log_probs(pb)`` (no grad) then ``actor.update(pb, adv, old)``. Modes:

- ``one pass``: ``ppo_micro_batch_size_per_gpu`` = the batch's rows, the behaviour before the
  change (every tail padded to the longest);
- ``tail buckets``: the default (no micro-batch size): rows cut where a long tail would pad
  the rest.

Both compute the same gradients (``tests/test_tail_buckets.py``). Each repeat runs both modes in
turn on a fresh copy of the same weights; the table gives medians. One thread
(``OMP_NUM_THREADS=1``); the load average is recorded.

    python bench/bench_tail_buckets.py [--repeats 3] [--outliers 0 1 3]
"""

from __future__ import annotations

import argparse
import copy
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import load_average, table, versions, write_result  # noqa: E402

PREFIX, QUESTION = 324, 36


def make_batch(vocab: int, prompts: int, samples: int, outliers: int, seed: int = 0):
    """The main job's GRPO shape with ``outliers`` long answers (spread over the prompts)."""
    import torch

    from agentloop_trainer.update import PolicyBatch

    rng = random.Random(seed)
    common = [rng.randrange(3, vocab) for _ in range(PREFIX)]
    long_rows = set(rng.sample(range(prompts * samples), outliers))
    seqs, plens = [], []
    for g in range(prompts):
        head = common + [rng.randrange(3, vocab) for _ in range(QUESTION + rng.randint(-4, 4))]
        for k in range(samples):
            n = rng.randint(200, 250) if g * samples + k in long_rows else rng.randint(41, 51)
            seqs.append(head + [rng.randrange(3, vocab) for _ in range(n)])
            plens.append(len(head))
    R = max(len(s) - p for s, p in zip(seqs, plens, strict=True))
    mask = torch.zeros(len(seqs), R)
    for b, (s, p) in enumerate(zip(seqs, plens, strict=True)):
        mask[b, : len(s) - p] = 1.0
    return PolicyBatch(seqs, plens, mask, None), torch.randn(len(seqs), generator=torch.Generator().manual_seed(seed))


def one_step(model: Any, overrides: dict[str, Any], pb: Any, adv: Any) -> tuple[float, float, float]:
    """Seconds of (log-prob pass, update pass) and the update's micro-batches."""
    from agentloop_trainer.update import ActorConfig, PolicyGradientActor

    actor = PolicyGradientActor(model, ActorConfig(lr=1e-5, tis_cap=None, **overrides))
    start = time.perf_counter()
    old = actor.compute_log_probs(pb)
    mid = time.perf_counter()
    metrics = actor.update(pb, adv, old)
    return mid - start, time.perf_counter() - mid, metrics["actor/micro_batches"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--outliers", type=int, nargs="*", default=[0, 1, 3])
    args = ap.parse_args()

    import torch

    from agentloop_core.testing import load_tiny_tokenizer
    from agentloop_trainer.policy import build_tiny_policy

    torch.set_num_threads(1)
    start_load = load_average()
    model = build_tiny_policy(load_tiny_tokenizer(), seed=0)
    rows_n = args.prompts * args.samples
    modes = {"one pass": {"ppo_micro_batch_size_per_gpu": rows_n}, "tail buckets": {}}
    results: dict[str, Any] = {}
    rows = []
    for outliers in args.outliers:
        pb, adv = make_batch(model.config.vocab_size, args.prompts, args.samples, outliers)
        one_step(copy.deepcopy(model), modes["tail buckets"], pb, adv)  # warm-up
        runs: dict[str, list[tuple[float, float, float]]] = {m: [] for m in modes}
        for rep in range(args.repeats):
            for mode, overrides in modes.items():
                runs[mode].append(one_step(copy.deepcopy(model), overrides, pb, adv))
                lp, up, parts = runs[mode][-1]
                print(f"outliers {outliers} repeat {rep + 1} {mode}: log-probs {lp:.2f}s, update {up:.2f}s, "
                      f"{parts:.0f} micro-batches", flush=True)
        tokens = sum(map(len, pb.sequences))
        res = {}
        for mode, times in runs.items():
            step = statistics.median(a + b for a, b, _ in times)
            res[mode] = {"log_prob_s": [a for a, _, _ in times], "update_s": [b for _, b, _ in times],
                         "micro_batches": times[0][2], "median_step_s": step, "tokens_per_s": tokens / step}
        speedup = res["one pass"]["median_step_s"] / res["tail buckets"]["median_step_s"]
        results[str(outliers)] = {"tokens": tokens, "modes": res, "speedup": speedup}
        for mode, m in res.items():
            rows.append([outliers, mode, m["micro_batches"], statistics.median(m["log_prob_s"]),
                         statistics.median(m["update_s"]), m["median_step_s"], m["tokens_per_s"],
                         f"{speedup:.2f}x" if mode == "tail buckets" else ""])
    text = table(["long answers", "mode", "micro-batches", "log-probs s", "update s", "step s", "tokens/s",
                  "vs one pass"], rows,
                 title=f"tiny policy, {args.prompts} x {args.samples} rows (median of {args.repeats}; load "
                       f"{start_load} at start)")
    write_result("tail_buckets", {
        "description": __doc__, "load_average_at_start": start_load, "repeats": args.repeats,
        "versions": versions("torch", "transformers"), "results": results, "table": text,
    })


if __name__ == "__main__":
    main()
