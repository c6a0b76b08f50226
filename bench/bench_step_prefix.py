"""An SFT step in micro-batches: the shared prefix run once per micro-batch against once per step
(``update/step_prefix.py``, issue 49 item 3: the real-model job's SFT stage).

The batch has the real-model recipe's shape (examples/trainer/smollm2_calculator.yaml, measured
on its demonstrations with SmolLM2's tokenizer): ``--rows`` conversations in micro-batches of
``--micro``, each a ``--prefix``-token common prefix (system turn and tool schema), a ~25-token
question of its own and ~75 trained tokens (tool call, tool result, answer). Random ids on a
SmolLM2-135M-shaped model (hidden 576, MLP 1536, 9 heads, 3 KV heads, vocabulary 49152, tied
embeddings; ``--layers`` decoder layers, random weights; ``--model DIR`` takes a checkpoint
instead). One measured step is ``sft_step`` with the recipe's settings (bfloat16 autocast where
``model.dtype=auto`` picks it, else float32). Modes:

- ``prefix per micro-batch``: ``prefix_per_step=False``, the behaviour before the change;
- ``prefix per step``: the default.

Both give the same gradient (``tests/test_step_prefix.py``). Each repeat runs both modes in turn
on the same weights (learning rate 0); the table gives medians. Threads: torch's default.

    python bench/bench_sft_prefix.py [--layers 30] [--repeats 3]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import load_average, table, versions, write_result  # noqa: E402
from bench_cpu_dtype import smollm2_shaped  # noqa: E402

QUESTION, TRAINED = 25, 75


def make_batch(vocab: int, rows: int, prefix: int, seed: int = 0):
    """``rows`` conversations: the common prefix, a question of their own, trained tokens."""
    from agentloop_trainer.stages.sft.tokenize import TokenizedConversation

    rng = random.Random(seed)
    common = [rng.randrange(3, vocab) for _ in range(prefix)]
    out = []
    for _ in range(rows):
        q, a = QUESTION + rng.randint(-5, 5), TRAINED + rng.randint(-10, 10)
        ids = common + [rng.randrange(3, vocab) for _ in range(q + a)]
        out.append(TokenizedConversation(ids, [0] * (prefix + q) + [1] * a))
    return out


def main() -> None:
    import torch

    from agentloop_trainer.policy.precision import resolve_dtype
    from agentloop_trainer.stages.sft.loss import make_optimizer, sft_step

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=30, help="decoder layers of the SmolLM2-shaped model")
    parser.add_argument("--model", help="a checkpoint folder instead of the random SmolLM2-shaped model")
    parser.add_argument("--rows", type=int, default=16, help="conversations in the step")
    parser.add_argument("--micro", type=int, default=4, help="conversations per micro-batch")
    parser.add_argument("--prefix", type=int, default=210, help="tokens every conversation shares")
    parser.add_argument("--repeats", type=int, default=3, help="timed steps per mode")
    args = parser.parse_args()

    if args.model:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    else:
        model = smollm2_shaped(args.layers)
    model.train()
    load_at_start = load_average()
    dtype = resolve_dtype("auto", "cpu", notice=lambda _m: None)
    batch = make_batch(model.config.vocab_size, args.rows, args.prefix)
    opt = make_optimizer(model, 0.0)
    modes = {"prefix per micro-batch": False, "prefix per step": True}
    times: dict[str, list[float]] = {m: [] for m in modes}

    def step(per_step: bool) -> float:
        t = time.perf_counter()
        sft_step(model, opt, batch, 0.0, micro_batch_size=args.micro, compute_dtype=dtype, prefix_per_step=per_step)
        return time.perf_counter() - t

    for per_step in modes.values():  # untimed: first-call allocations and kernel set-up
        step(per_step)
    for r in range(args.repeats):
        for mode, per_step in modes.items():
            times[mode].append(step(per_step))
            print(f"repeat {r + 1}/{args.repeats} {mode}: {times[mode][-1]:.2f} s", flush=True)

    tokens = sum(len(c.input_ids) for c in batch)
    base = statistics.median(times["prefix per micro-batch"])
    rows = [[mode, round(statistics.median(times[mode]), 2), round(tokens / statistics.median(times[mode])),
             round(statistics.median(times[mode]) / base, 3)] for mode in modes]
    shape = (f"{'checkpoint ' + args.model if args.model else f'SmolLM2-shaped, {args.layers} layers'}, "
             f"{args.rows} conversations in micro-batches of {args.micro}, common prefix {args.prefix} tokens, "
             f"{dtype}, {torch.get_num_threads()} threads")
    headers = ["mode", "step s (median)", "tokens/s", "vs per micro-batch"]
    table(headers, rows, title=shape)
    write_result("sft_prefix", {"shape": shape, "headers": headers, "rows": rows, "times": times,
                                "load_average_at_start": load_at_start, "versions": versions("torch", "transformers")})


if __name__ == "__main__":
    main()
