"""bfloat16 mixed precision against float32 on this CPU: why ``model.dtype=auto`` exists.

A SmolLM2-135M-shaped causal LM (hidden 576, MLP 1536, 9 heads of 64, 3 KV heads, vocabulary
49152, tied embeddings; ``--layers`` decoder layers, random weights, no checkpoint needed) runs one
training step, forward and backward of a mean log-sum-exp loss over ``--rows`` x ``--length``
tokens, in float32 and under ``torch.autocast(bfloat16)`` over float32 weights (what
``model.dtype=bfloat16`` does on one process). Each repeat runs both modes in turn after one
untimed step each; the table gives medians, and says what ``model.dtype=auto`` picks here.

On a CPU with AVX512_BF16 or AMX autocast is the faster mode; on one without (AVX2 only) oneDNN
has no bfloat16 kernel and the step is many times slower than float32.

    python bench/bench_cpu_dtype.py [--layers 2] [--rows 2] [--length 320] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import load_average, table, versions, write_result  # noqa: E402


def smollm2_shaped(layers: int):
    """A randomly initialised causal LM of SmolLM2-135M's layer and vocabulary shapes."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3,
                         num_hidden_layers=layers, vocab_size=49152, tie_word_embeddings=True,
                         max_position_embeddings=2048)
    return LlamaForCausalLM(config).float()


def step_seconds(model, ids, autocast: bool) -> float:
    import torch

    start = time.perf_counter()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        logits = model(input_ids=ids).logits
    logits.float().logsumexp(-1).mean().backward()
    model.zero_grad(set_to_none=True)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--rows", type=int, default=2)
    parser.add_argument("--length", type=int, default=320)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    import torch

    from agentloop_trainer.policy.precision import cpu_has_native_bf16, resolve_dtype

    model = smollm2_shaped(args.layers)
    ids = torch.randint(0, 49152, (args.rows, args.length), generator=torch.Generator().manual_seed(1))
    modes = {"float32": False, "bfloat16 autocast": True}
    times: dict[str, list[float]] = {mode: [] for mode in modes}
    for autocast in modes.values():
        step_seconds(model, ids, autocast)  # untimed: oneDNN's kernels are built on first use
    for repeat in range(args.repeats):
        for mode, autocast in modes.items():
            times[mode].append(step_seconds(model, ids, autocast))
            print(f"repeat {repeat + 1}/{args.repeats} {mode}: {times[mode][-1]:.2f} s", file=sys.stderr, flush=True)

    tokens = args.rows * args.length
    fp32 = statistics.median(times["float32"])
    native = cpu_has_native_bf16()
    picked = resolve_dtype("auto", "cpu", lambda _line: None)
    rows = [[mode, statistics.median(t), tokens / statistics.median(t), statistics.median(t) / fp32]
            for mode, t in times.items()]
    caps = {"cpu_capability": torch.backends.cpu.get_cpu_capability(), "native_bf16": native,
            "threads": torch.get_num_threads()}
    table(["mode", "step s (median)", "tokens/s", "vs float32"], rows,
          title=(f"SmolLM2-shaped, {args.layers} layers, {args.rows} x {args.length} tokens, forward + backward; "
                 f"CPU {caps['cpu_capability']}, native bfloat16: {native}; model.dtype=auto picks {picked}"))
    write_result("cpu_dtype", {
        "what": "one training step of a SmolLM2-shaped model, float32 vs bfloat16 autocast",
        "args": vars(args), **caps, "auto_picks": picked, "load_average": load_average(),
        "versions": versions("torch", "transformers"),
        "rows": [{"mode": r[0], "step_s": r[1], "tokens_per_s": r[2], "vs_float32": r[3],
                  "all_s": times[r[0]]} for r in rows],
    })


if __name__ == "__main__":
    main()
