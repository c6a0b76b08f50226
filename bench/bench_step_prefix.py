"""A step in micro-batches: the prefix every row shares run once per micro-batch against once per
optimizer step (``update/step_prefix.py``, issue 49 item 3: the real-model job).

Two steps of the real-model recipe (examples/trainer/smollm2_calculator.yaml), their shapes
measured on its data with SmolLM2's tokenizer, on random ids:

- ``sft``: ``sft_step`` on ``--sft-rows`` conversations in micro-batches of ``--sft-micro``,
  each the ``--prefix``-token common prefix (system turn and tool schema), a ~25-token question
  of its own and ~75 trained tokens (tool call, tool result, answer);
- ``grpo``: ``PolicyGradientActor.update`` on ``--prompts`` prompts x ``--samples`` samples in
  micro-batches of ``--grpo-micro`` rows, each prompt the same prefix and a ~25-token question,
  each answer ~110 tokens (two turns), on-policy (no old log-probs pass).

The model is SmolLM2-135M-shaped (hidden 576, MLP 1536, 9 heads, 3 KV heads, vocabulary 49152,
tied embeddings; ``--layers`` decoder layers, random weights), in bfloat16 autocast where
``model.dtype=auto`` picks it, else float32; learning rate 0, so every repeat sees the same
weights. Modes:

- ``per micro-batch``: every micro-batch runs the prefix itself (the behaviour before the
  change: the step-prefix builders are switched off);
- ``per step``: the default.

Both give the same gradients (``tests/test_step_prefix.py``). Each repeat runs both modes in
turn; the table gives medians. Threads: torch's default.

    python bench/bench_step_prefix.py [--layers 30] [--repeats 3]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import load_average, table, versions, write_result  # noqa: E402
from bench_cpu_dtype import smollm2_shaped  # noqa: E402

QUESTION, TRAINED, ANSWER = 25, 75, 110


def sft_batch(vocab: int, rows: int, prefix: list[int], rng: random.Random) -> list:
    """``rows`` conversations: the common prefix, a question of their own, trained tokens."""
    from agentloop_trainer.stages.sft.tokenize import TokenizedConversation

    out = []
    for _ in range(rows):
        q, a = QUESTION + rng.randint(-5, 5), TRAINED + rng.randint(-10, 10)
        ids = prefix + [rng.randrange(3, vocab) for _ in range(q + a)]
        out.append(TokenizedConversation(ids, [0] * (len(prefix) + q) + [1] * a))
    return out


def grpo_batch(vocab: int, prompts: int, samples: int, prefix: list[int], rng: random.Random):
    """A GRPO batch: ``prompts`` prompts on the common prefix, ``samples`` answers each."""
    import torch

    from agentloop_trainer.update import PolicyBatch

    seqs, plens = [], []
    for _ in range(prompts):
        head = prefix + [rng.randrange(3, vocab) for _ in range(QUESTION + rng.randint(-5, 5))]
        for _ in range(samples):
            seqs.append(head + [rng.randrange(3, vocab) for _ in range(ANSWER + rng.randint(-40, 40))])
            plens.append(len(head))
    R = max(len(s) - p for s, p in zip(seqs, plens, strict=True))
    mask = torch.zeros(len(seqs), R)
    for b, (s, p) in enumerate(zip(seqs, plens, strict=True)):
        mask[b, : len(s) - p] = 1
    return PolicyBatch(seqs, plens, mask, None), torch.randn(len(seqs), generator=torch.Generator().manual_seed(0))


def main() -> None:
    import torch

    import agentloop_trainer.stages.sft.loss as sft_loss_module
    from agentloop_trainer.policy.precision import resolve_dtype
    from agentloop_trainer.update import ActorConfig, PolicyGradientActor

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=30, help="decoder layers of the SmolLM2-shaped model")
    parser.add_argument("--prefix", type=int, default=210, help="tokens every row shares")
    parser.add_argument("--sft-rows", type=int, default=16, help="conversations in the SFT step")
    parser.add_argument("--sft-micro", type=int, default=4, help="conversations per SFT micro-batch")
    parser.add_argument("--prompts", type=int, default=8, help="prompts in the GRPO batch")
    parser.add_argument("--samples", type=int, default=8, help="samples per prompt")
    parser.add_argument("--grpo-micro", type=int, default=8, help="rows per GRPO micro-batch")
    parser.add_argument("--repeats", type=int, default=3, help="timed steps per mode")
    args = parser.parse_args()

    load_at_start = load_average()
    model = smollm2_shaped(args.layers).train()
    dtype = resolve_dtype("auto", "cpu", notice=lambda _m: None)
    vocab = model.config.vocab_size
    rng = random.Random(0)
    prefix = [rng.randrange(3, vocab) for _ in range(args.prefix)]
    sft = sft_batch(vocab, args.sft_rows, prefix, rng)
    pb, adv = grpo_batch(vocab, args.prompts, args.samples, prefix, rng)
    opt = sft_loss_module.make_optimizer(model, 0.0)
    actor = PolicyGradientActor(model, ActorConfig(lr=0.0, compute_dtype=dtype, ppo_micro_batch_size_per_gpu=args.grpo_micro,
                                                   rollout_n=args.samples))
    builders = (sft_loss_module.step_prefix, actor._step_prefix)

    def per_step(on: bool) -> None:
        sft_loss_module.step_prefix = builders[0] if on else (lambda *_a, **_k: None)
        actor._step_prefix = builders[1] if on else (lambda *_a, **_k: None)

    steps: dict[str, Callable[[], object]] = {
        "sft": lambda: sft_loss_module.sft_step(model, opt, sft, 0.0, micro_batch_size=args.sft_micro,
                                                compute_dtype=dtype),
        "grpo": lambda: actor.update(pb, adv, None),
    }
    modes = {"per micro-batch": False, "per step": True}
    times = {(s, m): [] for s in steps for m in modes}
    for run in steps.values():  # untimed: first-call allocations and kernel set-up
        for on in modes.values():
            per_step(on)
            run()
    for r in range(args.repeats):
        for name, run in steps.items():
            for mode, on in modes.items():
                per_step(on)
                t = time.perf_counter()
                run()
                times[(name, mode)].append(time.perf_counter() - t)
                print(f"repeat {r + 1}/{args.repeats} {name} {mode}: {times[(name, mode)][-1]:.2f} s", flush=True)
    per_step(True)

    tokens = {"sft": sum(len(c.input_ids) for c in sft), "grpo": sum(len(s) for s in pb.sequences)}
    rows = []
    for name in steps:
        base = statistics.median(times[(name, "per micro-batch")])
        for mode in modes:
            med = statistics.median(times[(name, mode)])
            rows.append([name, mode, round(med, 2), round(tokens[name] / med), round(med / base, 3)])
    shape = (f"SmolLM2-shaped, {args.layers} layers, prefix {args.prefix} tokens; SFT {args.sft_rows} conversations "
             f"in micro-batches of {args.sft_micro}; GRPO {args.prompts} x {args.samples} in micro-batches of "
             f"{args.grpo_micro}; {dtype}, {torch.get_num_threads()} threads")
    headers = ["step", "prefix", "step s (median)", "tokens/s", "vs per micro-batch"]
    table(headers, rows, title=shape)
    write_result("step_prefix", {"shape": shape, "headers": headers, "rows": rows,
                                 "times": {f"{s} / {m}": v for (s, m), v in times.items()},
                                 "load_average_at_start": load_at_start, "versions": versions("torch", "transformers")})


if __name__ == "__main__":
    main()
