"""Target log-probs a few rows at a time against the whole logits tensor cast to float32
(``update/picked_log_probs.py``, issue 49 item 3: the real-model job).

Two levels, each with the plain computation (``logits[:, :-1].float() / T``, then ``gather``
minus ``logsumexp``: what the trainer ran before) and the chunked one (the default), alternating
within each repeat, medians reported:

- ``op``: the log-probs alone, forward and backward, on ``[--rows, --positions, 49152]`` logits
  (SmolLM2's vocabulary) in bfloat16 (what the model's head gives under autocast) and float32;
- ``grpo`` / ``sft``: the real-model recipe's GRPO update and SFT step on a SmolLM2-135M-shaped
  model (``--layers`` decoder layers, random weights; the shapes of ``bench_step_prefix.py``:
  a 210-token shared prefix, a ~25-token question, ~110 answer tokens for GRPO's 8 x 8 rows in
  micro-batches of 8, ~75 trained tokens for SFT's 16 conversations in micro-batches of 4), in
  bfloat16 autocast where ``model.dtype=auto`` picks it, else float32; learning rate 0, so every
  repeat sees the same weights.

Both give the same values and gradients (``tests/test_picked_log_probs.py``). Threads: torch's
default.

    python bench/bench_picked_log_probs.py [--layers 30] [--repeats 3]
"""

from __future__ import annotations

import argparse
import functools
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import load_average, table, versions, write_result  # noqa: E402
from bench_cpu_dtype import smollm2_shaped  # noqa: E402
from bench_step_prefix import grpo_batch, sft_batch  # noqa: E402

VOCAB = 49152


def plain_log_probs(logits: Any, targets: Any, temperature: float = 1.0) -> Any:
    """The computation before the change, with the chunked function's signature."""
    import torch

    x = logits[..., : targets.shape[-1], :].float()
    if temperature != 1.0:
        x = x / temperature
    return x.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(x, dim=-1)


def op_seconds(fn: Callable[..., Any], *, logits: Any, targets: Any, weights: Any) -> float:
    x = logits.clone().requires_grad_(True)
    start = time.perf_counter()
    (fn(x, targets) * weights).sum().backward()
    return time.perf_counter() - start


def main() -> None:
    import torch

    import agentloop_trainer.stages.sft.loss as sft_loss_module
    from agentloop_trainer.policy.precision import resolve_dtype
    from agentloop_trainer.update import ActorConfig, PolicyGradientActor, placeholder_mask
    from agentloop_trainer.update.picked_log_probs import picked_log_probs

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=30, help="decoder layers of the SmolLM2-shaped model")
    parser.add_argument("--rows", type=int, default=8, help="rows of the op-level logits")
    parser.add_argument("--positions", type=int, default=150, help="positions per row of the op-level logits")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per mode")
    parser.add_argument("--skip-steps", action="store_true", help="the op level only")
    args = parser.parse_args()

    load_at_start = load_average()
    ways: dict[str, Callable[..., Any]] = {"whole tensor (before)": plain_log_probs, "chunked": picked_log_probs}
    gen = torch.Generator().manual_seed(0)
    shape = (args.rows, args.positions + 1, VOCAB)
    targets = torch.randint(0, VOCAB, (args.rows, args.positions), generator=gen)
    weights = torch.randn(args.rows, args.positions, generator=gen)
    steps: dict[str, Callable[[Callable[..., Any]], float]] = {}
    for dtype in (torch.bfloat16, torch.float32):
        logits = (torch.randn(shape, generator=gen) * 3).to(dtype)
        steps[f"op, {str(dtype).removeprefix('torch.')}"] = functools.partial(op_seconds, logits=logits,
                                                                              targets=targets, weights=weights)

    dtype = resolve_dtype("auto", "cpu", notice=lambda _m: None)
    if not args.skip_steps:
        model = smollm2_shaped(args.layers).train()
        rng = random.Random(0)
        prefix = [rng.randrange(3, VOCAB) for _ in range(210)]
        sft = sft_batch(VOCAB, 16, prefix, rng)
        pb, adv = grpo_batch(VOCAB, 8, 8, prefix, rng)
        opt = sft_loss_module.make_optimizer(model, 0.0)
        actor = PolicyGradientActor(model, ActorConfig(lr=0.0, compute_dtype=dtype, ppo_micro_batch_size_per_gpu=8,
                                                       rollout_n=8))

        def timed(run: Callable[[], object]) -> float:
            start = time.perf_counter()
            run()
            return time.perf_counter() - start

        steps["grpo update"] = lambda fn: timed(lambda: actor.update(pb, adv, None))
        steps["sft step"] = lambda fn: timed(lambda: sft_loss_module.sft_step(model, opt, sft, 0.0, micro_batch_size=4,
                                                                                compute_dtype=dtype))
    original = placeholder_mask.picked_log_probs

    def use(fn: Callable[..., Any]) -> None:
        placeholder_mask.picked_log_probs = fn

    times: dict[tuple[str, str], list[float]] = {(s, w): [] for s in steps for w in ways}
    for run in steps.values():
        for fn in ways.values():  # untimed: first-call allocations and kernel set-up
            use(fn)
            run(fn)
    for r in range(args.repeats):
        for name, run in steps.items():
            for way, fn in ways.items():
                use(fn)
                times[(name, way)].append(run(fn))
                print(f"repeat {r + 1}/{args.repeats} {name} {way}: {times[(name, way)][-1]:.3f} s", flush=True)
    use(original)

    rows = []
    for name in steps:
        base = statistics.median(times[(name, "whole tensor (before)")])
        for way in ways:
            med = statistics.median(times[(name, way)])
            rows.append([name, way, round(med, 3), round(med / base, 3)])
    title = (f"op: [{args.rows}, {args.positions + 1}, {VOCAB}] logits, forward + backward; steps: SmolLM2-shaped, "
             f"{args.layers} layers, {dtype}; {torch.get_num_threads()} threads")
    headers = ["what", "log-probs", "seconds (median)", "vs before"]
    table(headers, rows, title=title)
    write_result("picked_log_probs", {"shape": title, "headers": headers, "rows": rows,
                                      "times": {f"{s} / {w}": v for (s, w), v in times.items()},
                                      "load_average_at_start": load_at_start,
                                      "versions": versions("torch", "transformers")})


if __name__ == "__main__":
    main()
