"""Prefix reuse across turns in HFServer (``prefix_cache_tokens``): cache off vs on on 5-turn
tool trajectories.

Each trajectory starts from a prompt (a system/tool-schema part every trajectory shares plus a
task of its own), then for each turn generates ``--gen`` tokens (greedy, EOS ignored so every
run does the same work) and appends a tool result of ``--tool`` tokens. All trajectories run
concurrently on one server, as a rollout does. Reported per trajectory: prefill tokens
computed, its distinct tokens (the final prompt plus the last completion: every token it holds)
and their ratio; and rollout tokens/s (generated tokens over wall time). Greedy tokens of the
two runs are compared (they must be equal).

Runs the tiny model, and SmolLM2-135M-Instruct when a converted folder exists locally
(``~/.cache/agentloop/pretrained/*/provenance.json`` naming it, or ``--smollm2-dir``); it
downloads nothing. Writes ``bench/results/prefix_reuse.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from pathlib import Path
from typing import Any

from _common import load_average, table, versions, write_result

TURNS = 5


def smollm2_dir() -> str | None:
    """A converted SmolLM2-135M-Instruct folder already on this machine, or None."""
    root = Path.home() / ".cache" / "agentloop" / "pretrained"
    for prov in sorted(root.glob("*/provenance.json")):
        try:
            model = json.loads(prov.read_text()).get("origin", {}).get("model", "")
        except (OSError, ValueError):
            continue
        if model == "smollm2-135m-instruct":
            return str(prov.parent)
    return None


def prompts(n: int, vocab: int, shared: int, own: int) -> list[list[int]]:
    base = [(17 * i) % (vocab - 100) + 50 for i in range(shared)]
    return [base + [(31 * i + 7 * t) % (vocab - 100) + 50 for i in range(own)] for t in range(n)]


async def run(model_dir: str, cache_tokens: int, args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from agentloop_engines.adapters.hf import HFServer

    torch.set_num_threads(args.threads)
    server = HFServer(model_dir, max_batch_size=64, prefix_cache_tokens=cache_tokens)
    vocab = server.vocab_size
    params = {"max_tokens": args.gen, "temperature": 0, "ignore_eos": True, "logprobs": True}
    await server.generate("warmup", prompts(1, vocab, 8, 8)[0], {**params, "max_tokens": 2})
    if server.prefix_cache is not None:
        server.prefix_cache.clear()
    before = dict(server.stats)

    async def trajectory(tid: int, prompt: list[int]) -> tuple[list[list[int]], int]:
        outs = []
        for turn in range(TURNS):
            out = await server.generate(f"traj-{tid}", prompt, params)
            outs.append(out.token_ids)
            if turn < TURNS - 1:
                tool = [(13 * turn + 3 * i + tid) % (vocab - 100) + 50 for i in range(args.tool)]
                prompt = prompt + out.token_ids + tool
        return outs, len(prompt) + len(outs[-1])

    start = time.perf_counter()
    results = await asyncio.gather(*(trajectory(t, p) for t, p in enumerate(
        prompts(args.trajectories, vocab, args.shared, args.own))))
    wall = time.perf_counter() - start
    stats = {k: server.stats[k] - before.get(k, 0) for k in server.stats}
    await server.close()
    distinct = sum(n for _, n in results) / len(results)
    prefill = stats["prefill_tokens"] / len(results)
    return {
        "prefix_cache_tokens": cache_tokens,
        "wall_s": wall,
        "generated_tokens": stats["generated_tokens"],
        "rollout_tokens_per_s": stats["generated_tokens"] / wall,
        "prefill_tokens_per_trajectory": prefill,
        "distinct_tokens_per_trajectory": distinct,
        "prefill_over_distinct": prefill / distinct,
        "stats": stats,
        "tokens": [outs for outs, _ in results],
    }


def bench_model(name: str, model_dir: str, args: argparse.Namespace) -> dict[str, Any]:
    off = asyncio.run(run(model_dir, 0, args))
    on = asyncio.run(run(model_dir, args.cache_tokens, args))
    same = off.pop("tokens") == on.pop("tokens")
    rows = [[label, r["prefill_tokens_per_trajectory"], r["distinct_tokens_per_trajectory"],
             r["prefill_over_distinct"], r["rollout_tokens_per_s"], r["stats"]["prefix_cache_hits"]]
            for label, r in (("off", off), ("on", on))]
    table(["cache", "prefill tok/traj", "distinct tok/traj", "prefill/distinct", "rollout tok/s", "hits"], rows,
          title=f"{name}: {args.trajectories} trajectories x {TURNS} turns, same greedy tokens: {same}")
    speedup = on["rollout_tokens_per_s"] / off["rollout_tokens_per_s"]
    print(f"rollout tokens/s on/off: {speedup:.2f}x\n", flush=True)
    return {"model_dir": model_dir, "off": off, "on": on, "same_greedy_tokens": same, "speedup": speedup}


def main() -> None:
    parser = argparse.ArgumentParser(description="HFServer prefix reuse across turns: cache off vs on")
    parser.add_argument("--trajectories", type=int, default=8)
    parser.add_argument("--shared", type=int, default=160, help="prompt tokens every trajectory shares")
    parser.add_argument("--own", type=int, default=40, help="prompt tokens of each trajectory's own")
    parser.add_argument("--gen", type=int, default=24, help="tokens generated per turn")
    parser.add_argument("--tool", type=int, default=40, help="tool-result tokens appended per turn")
    parser.add_argument("--cache-tokens", type=int, default=1 << 16, help="prefix_cache_tokens when on")
    parser.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS") or 1))
    parser.add_argument("--smollm2-dir", default=None)
    parser.add_argument("--no-smollm2", action="store_true")
    args = parser.parse_args()
    from agentloop_engines.testing.tiny_model import build_tiny_model

    load_before = load_average()
    models = {"tiny-qwen2": bench_model("tiny-qwen2", str(build_tiny_model()), args)}
    real = None if args.no_smollm2 else (args.smollm2_dir or smollm2_dir())
    if real:
        models["smollm2-135m-instruct"] = bench_model("smollm2-135m-instruct", real, args)
    else:
        print("no converted SmolLM2 folder here: tiny model only")
    write_result("prefix_reuse", {
        "what": "HFServer prefix_cache_tokens off vs on: concurrent 5-turn tool trajectories, greedy",
        "settings": {k: v for k, v in vars(args).items() if k != "smollm2_dir"} | {"turns": TURNS},
        "load_average_at_start": load_before,
        "versions": versions("torch", "transformers"),
        "models": models,
    })


if __name__ == "__main__":
    main()
