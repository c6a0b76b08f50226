"""Benchmark 7 (issue 17): memory and time of one GRPO update, option by option.

A Qwen2 built locally with random init (nothing downloaded): on the CPU ~110M parameters
(hidden 768, 12 layers, 12 heads, intermediate 2048, vocab 32000, tied embeddings); with
``--device cuda`` ~0.5B (hidden 896, 24 layers, 14 heads, 2 key/value heads, intermediate 4864,
vocab 151936, tied), the shape of Qwen2.5-0.5B. One GRPO update is the real actor's
``PolicyGradientActor.update(batch, advantages)`` with ``old_log_probs=None`` (on-policy, one optimizer
step: what the trainer runs with ``ppo_epochs=1``), AdamW, on a batch like two GRPO groups: 8
sequences sharing a 64-token prefix (a system prompt), 16 more prompt tokens per group of 4, 48
response tokens each: 128 tokens a sequence, random ids, random advantages (``--prefix``,
``--prompt``, ``--response``, ``--rows`` change it; 256-token sequences took over 10 minutes on
the loaded 2-core machine, hence 128).

Configurations, cumulative in the issue's order, each in a FRESH subprocess so its peak is its
own:

1. ``fp32``: float32 weights and compute.
2. ``bf16``: ``ActorConfig(compute_dtype="bfloat16")``, autocast over float32 master weights.
3. ``+ gradient checkpointing``: ``enable_gradient_checkpointing(model)`` and
   ``share_prefix_with_grad=False`` (a checkpointed layer cannot keep the prefix's cache).
4. ``+ micro-batches``: ``ppo_micro_batch_size_per_gpu=2`` (4 passes, gradients accumulated).
5. ``+ LoRA``: ``apply_lora(model, 16, 32, "all-linear")``: only the adapters train.
6. ``+ offload``: sharded over a ONE-rank process group (gloo on CPU, NCCL on CUDA) with
   ``shard_policy(model, device, "bfloat16", offload=True)``: FSDP2 ``CPUOffloadPolicy`` and
   bf16 mixed precision from FSDP (so ``compute_dtype=None``).

Memory (CPU): peak RSS of the process (``ru_maxrss``); RSS once the model and actor are built
(before any update; AdamW allocates its state at the first step); the peak during the updates
above that in the first update (which allocates AdamW's state), and the peak of each later
update above the RSS it starts from (its own working memory), both up to the optimizer step
(forward and backward passes: activations, gradients) and over the whole update (AdamW's step
and its temporaries included) (``VmHWM`` after a reset through ``/proc/self/clear_refs``).
Large allocations go back to the OS when freed (``MALLOC_MMAP_THRESHOLD_``), so RSS follows
what is live.
Memory (CUDA): ``torch.cuda.memory_allocated`` / ``max_memory_allocated`` likewise.
"params+grads+AdamW" is analytic: 4 bytes per parameter (float32 master weights) + 4 + 8 bytes
per trainable parameter (float32 gradient, AdamW's two moments). Time: median of the timed
updates after one warm-up update (``--timed``, default 2).

Weight push: ``iter_policy_weights(model, bucket_bytes)`` over the whole fp32 model (and the
sharded LoRA model of row 6, adapters merged), 64 MB buckets vs one bucket: time to produce
every bucket and the largest bucket.

Run: ``python bench/bench_memory.py`` (writes ``bench/results/memory.json``);
``python bench/bench_memory.py --device cuda`` on a GPU (writes ``bench/results/memory_cuda.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import load_average, table, versions, write_result  # noqa: E402

MB = 1024 * 1024
SHAPES = {
    "cpu": {"hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12, "num_key_value_heads": 12,
            "intermediate_size": 2048, "vocab_size": 32000},
    "cuda": {"hidden_size": 896, "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2,
             "intermediate_size": 4864, "vocab_size": 151936},
}
# (row name, options it switches on); each row keeps the ones before it.
STEPS = [
    ("fp32", {}),
    ("bf16", {"bf16": True}),
    ("+ gradient checkpointing", {"checkpointing": True}),
    ("+ micro-batches of 2", {"micro": 2}),
    ("+ LoRA r16 all-linear", {"lora": True}),
    ("+ offload (FSDP2, 1 rank)", {"offload": True}),
]
PUSH_BUCKETS = {"64 MB buckets": 64 * MB, "one bucket": 1 << 62}


def configs() -> list[tuple[str, dict]]:
    """The cumulative configurations, in the issue's order."""
    out, opts = [], {"bf16": False, "checkpointing": False, "micro": None, "lora": False, "offload": False}
    for name, extra in STEPS:
        opts = {**opts, **extra}
        out.append((name, dict(opts)))
    return out


# ---------------------------------------------------------------- worker (one configuration)


class Memory:
    """Current and peak memory: host RSS on the CPU, allocated CUDA memory on a GPU."""

    def __init__(self, device: str) -> None:
        import torch

        self.cuda = device == "cuda"
        self.torch = torch

    @staticmethod
    def _status(field: str) -> int:
        line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith(field + ":"))
        return int(line.split()[1]) * 1024

    def now(self) -> int:
        return self.torch.cuda.memory_allocated() if self.cuda else self._status("VmRSS")

    def reset_peak(self) -> None:
        if self.cuda:
            self.torch.cuda.reset_peak_memory_stats()
        else:
            Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS

    def peak(self) -> int:
        return self.torch.cuda.max_memory_allocated() if self.cuda else self._status("VmHWM")

    def sync(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize()


def process_peak_rss() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def build_model(shape: dict):
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(**shape, max_position_embeddings=4096, tie_word_embeddings=True, use_cache=True,
                         bos_token_id=None, eos_token_id=1, pad_token_id=0)
    torch.manual_seed(0)
    return Qwen2ForCausalLM(config).to(torch.float32)


def make_batch(vocab: int, rows: int, prefix: int, prompt: int, response: int):
    """Groups of 4 rows: a prefix shared by all rows, then the group's own prompt tail, then
    each row's response (random ids); random advantages."""
    import torch

    from agentloop_trainer.update import PolicyBatch

    g = torch.Generator().manual_seed(0)
    shared = torch.randint(2, vocab, (prefix,), generator=g).tolist()
    seqs = []
    for r in range(rows):
        if r % 4 == 0:
            tail = torch.randint(2, vocab, (prompt - prefix,), generator=g).tolist()
        seqs.append(shared + tail + torch.randint(2, vocab, (response,), generator=g).tolist())
    return PolicyBatch(seqs, [prompt] * rows, torch.ones(rows, response), None), torch.randn(rows, generator=g)


def time_push(model, mem: Memory) -> dict:
    """Each bucket size, after a warm-up push: seconds to produce every bucket of the push, its
    largest bucket, and the host memory it held above what was there before."""
    from agentloop_trainer.update import iter_policy_weights

    for _ in iter_policy_weights(model, 1 << 62):  # warm-up (first-call imports and lookups)
        pass
    out = {}
    for name, size in PUSH_BUCKETS.items():
        before = Memory._status("VmRSS")
        Path("/proc/self/clear_refs").write_text("5")
        start = time.perf_counter()
        largest = buckets = 0
        for bucket in iter_policy_weights(model, size):
            largest = max(largest, sum(t.numel() * t.element_size() for _, t in bucket))
            buckets += 1
            del bucket
        mem.sync()
        out[name] = {"seconds": time.perf_counter() - start, "buckets": buckets, "largest_bucket_bytes": largest,
                     "host_peak_above_bytes": Memory._status("VmHWM") - before}
    return out


def run_config(opts: dict, device: str, shape: dict, batch: dict, timed: int, push: bool) -> dict:
    """Build, wrap and update one configuration in this (fresh) process; return its numbers."""
    import torch

    from agentloop_trainer.policy import apply_lora, enable_gradient_checkpointing
    from agentloop_trainer.update import ActorConfig, PolicyGradientActor

    mem = Memory(device)
    model = build_model(shape)
    total_params = sum(p.numel() for p in model.parameters())
    if opts["checkpointing"]:
        enable_gradient_checkpointing(model)
    if opts["lora"]:
        model = apply_lora(model, 16, 32, "all-linear")
    params = sum(p.numel() for p in model.parameters())  # base + adapters
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    if opts["offload"]:
        # What build_trainer does for a one-process offloaded run: a one-rank group of its own.
        from agentloop_trainer.update import free_port, init_process_group, shard_policy

        init_process_group(0, 1, free_port(), device)
        model = shard_policy(model, device, "bfloat16", offload=True)  # stays in host memory
    else:
        model = model.to(device)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    compute_dtype = "bfloat16" if opts["bf16"] and not opts["offload"] else None
    actor = PolicyGradientActor(model, ActorConfig(lr=1e-5, tis_cap=None, compute_dtype=compute_dtype,
                                         share_prefix_with_grad=not opts["checkpointing"],
                                         ppo_micro_batch_size_per_gpu=opts["micro"]), device=device)
    pb, adv = make_batch(shape["vocab_size"], **batch)
    mem.sync()
    load_peak = mem.peak()
    loaded = mem.now()
    seconds, peaks, above, before_step, losses, micro = [], [], [], [], [], 0.0
    step = actor.optimizer.step

    def step_after_noting_the_peak(*a, **kw):  # the forward/backward passes' peak, before AdamW's
        mem.sync()
        before_step.append(mem.peak())
        return step(*a, **kw)

    actor.optimizer.step = step_after_noting_the_peak
    for _ in range(1 + timed):
        mem.sync()
        before = mem.now()
        mem.reset_peak()
        start = time.perf_counter()
        metrics = actor.update(pb, adv)
        mem.sync()
        seconds.append(time.perf_counter() - start)
        peaks.append(mem.peak())
        above.append(peaks[-1] - before)
        before_step[-1] -= before
        losses.append(metrics["actor/pg_loss"])
        micro = metrics["actor/micro_batches"]
    update_peak = max(peaks)
    result = {
        "options": opts, "model_params": total_params, "params_with_adapters": params, "trainable_params": trainable,
        "analytic_state_bytes": 4 * params + 12 * trainable,
        "analytic_state_on_device_bytes": 0 if opts["offload"] else 4 * params + 12 * trainable,
        "loaded_bytes": loaded, "update_peak_bytes": update_peak, "update_peak_above_loaded_bytes": update_peak - loaded,
        # Later updates start with AdamW's state (and the last gradients) in place: their peak
        # above where they start is the update's own working memory (activations, gradients).
        "steady_update_peak_above_start_bytes": max(above[1:]),
        "steady_forward_backward_peak_above_start_bytes": max(before_step[1:]),
        "process_peak_bytes": max(load_peak, update_peak) if mem.cuda else process_peak_rss(),
        "process_peak_rss_bytes": process_peak_rss(), "warmup_s": seconds[0], "update_s": seconds[1:],
        "median_update_s": statistics.median(seconds[1:]), "pg_loss": losses, "micro_batches": micro,
    }
    if push:
        result["push"] = time_push(model, mem)
    if opts["offload"]:
        import torch.distributed as dist

        dist.destroy_process_group()
    return result


def worker(spec: str) -> None:
    s = json.loads(spec)
    result = run_config(s["opts"], s["device"], s["shape"], s["batch"], s["timed"], s["push"])
    print("RESULT " + json.dumps(result), flush=True)


# ---------------------------------------------------------------- driver


def run_fresh(spec: dict, threads: int, timeout_s: float) -> dict:
    """One configuration in a fresh interpreter (its own peak memory)."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false",
           # Big blocks come from mmap and go back to the OS when freed, so RSS tracks what is live.
           "MALLOC_MMAP_THRESHOLD_": str(256 * 1024)}
    try:
        proc = subprocess.run([sys.executable, __file__, "--worker", json.dumps(spec)], env=env, timeout=timeout_s,
                              capture_output=True, text=True)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout_s:.0f} s"}
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    if proc.returncode or not lines:
        return {"error": f"exit {proc.returncode}: {(proc.stderr or proc.stdout)[-1500:]}"}
    return json.loads(lines[-1][len("RESULT "):])


def mb(n: int) -> float:
    return n / MB


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads per configuration process (default: 2 on cpu, all cores on cuda)")
    parser.add_argument("--timed", type=int, default=2, help="timed updates after the warm-up (median reported)")
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--prefix", type=int, default=64, help="tokens every row shares")
    parser.add_argument("--prompt", type=int, default=80, help="prompt tokens per row (prefix included)")
    parser.add_argument("--response", type=int, default=48)
    parser.add_argument("--only", nargs="*", type=int, help="row numbers (1-6) to run")
    parser.add_argument("--timeout", type=float, default=400, help="seconds per configuration")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args.worker)
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise SystemExit("--device cuda: no CUDA device here (torch.cuda.is_available() is False, torch "
                             f"{torch.__version__}); run it on a GPU machine with a CUDA build of torch")
    if not Path("/proc/self/clear_refs").exists():
        raise SystemExit("bench_memory.py reads peak RSS from /proc (Linux only)")
    if args.threads is None:
        args.threads = 2 if args.device == "cpu" else os.cpu_count() or 1
    load_start = load_average()
    batch = {"rows": args.rows, "prefix": args.prefix, "prompt": args.prompt, "response": args.response}
    shape = SHAPES[args.device]
    results = {}
    for i, (name, opts) in enumerate(configs(), 1):
        if args.only and i not in args.only:
            continue
        spec = {"opts": opts, "device": args.device, "shape": shape, "batch": batch, "timed": args.timed,
                "push": name == "fp32" or opts["offload"]}
        start = time.perf_counter()
        results[name] = run_fresh(spec, args.threads, args.timeout)
        r = results[name]
        print(f"  {name}: " + (r["error"][-300:] if "error" in r else
              f"{r['median_update_s']:.2f} s, peak {mb(r['process_peak_bytes']):.0f} MB, "
              f"above loaded {mb(r['update_peak_above_loaded_bytes']):.0f} MB") +
              f" ({time.perf_counter() - start:.0f} s, load {load_average()})", flush=True)
    what = "RSS" if args.device == "cpu" else "CUDA allocated"
    rows = []
    for name, r in results.items():
        if "error" in r:
            rows.append((name, *["n/a"] * 7, r["error"].strip().splitlines()[-1][:80]))
            continue
        rows.append((name, f"{r['trainable_params'] / 1e6:.1f}M", round(mb(r["analytic_state_bytes"])),
                     round(mb(r["loaded_bytes"])), round(mb(r["process_peak_bytes"])),
                     round(mb(r["update_peak_above_loaded_bytes"])),
                     round(mb(r["steady_forward_backward_peak_above_start_bytes"])),
                     round(mb(r["steady_update_peak_above_start_bytes"])), round(r["median_update_s"], 2)))
    first = next((r for r in results.values() if "model_params" in r), {})
    tokens = args.rows * args.prompt + args.rows * args.response
    title = (f"One GRPO update, random-init Qwen2 of {first.get('model_params', 0) / 1e6:.0f}M parameters on "
             f"{args.device}, {args.rows} x {args.prompt + args.response} tokens ({args.prefix} shared, "
             f"{args.response} response), {args.threads} CPU threads")
    text = table(["configuration (cumulative)", "trainable", "params+grads+AdamW MB (analytic)",
                  f"{what} loaded MB", f"peak {what} MB", "1st update: peak above loaded MB",
                  "later updates, above their start: fwd+bwd peak MB", "whole-update peak MB",
                  "update s (median)"],
                 rows, title=title)
    push_rows = [(name, kind, round(p["seconds"], 3), p["buckets"], round(mb(p["largest_bucket_bytes"])),
                  round(mb(p["host_peak_above_bytes"])))
                 for name, r in results.items() for kind, p in r.get("push", {}).items()]
    push_text = table(["model", "push", "seconds", "buckets", "largest bucket MB", "host RSS peak above MB"],
                      push_rows, title="Weight push: iter_policy_weights over the whole model")
    write_result("memory" if args.device == "cpu" else "memory_cuda", {
        "description": __doc__.split("Run:")[0].strip(), "load_average_at_start": load_start,
        "versions": versions("torch", "transformers", "peft"), "device": args.device, "model_shape": shape,
        "batch": {**batch, "tokens": tokens}, "threads": args.threads, "timed_updates": args.timed,
        "results": results, "table_markdown": text, "push": {"table_markdown": push_text}})
    return None


if __name__ == "__main__":
    main()
