"""Benchmark (issue 21): synchronous vs one-step-off vs asynchronous GRPO on a long-tail workload.

What is simulated, so that the overlap is measurable on 2 shared cores:

* the engine: a latency-only engine (``AbortableLatencyEngine`` below, the per-token delay of
  ``latency_engine.LatencyOnlyEngine``): a call for ``k`` tokens takes ``k * per_token_s``
  seconds, nothing is computed, any number of sequences decode at once; ``abort`` ends a call
  at a token boundary with the tokens so far (``stop_reason="aborted"``), as a real engine's.
  It stands behind the real :class:`agentloop_core.partial_rollout.PartialRolloutServer`.
* the trajectories: multi-turn, a fixed number of tokens per turn and a tool call between turns;
  the number of turns is long-tailed (Pareto, capped), drawn per (group, sample) from a fixed
  seed, so every mode rolls out the same trajectories in the same start order.
* the update: a fixed-duration ``time.sleep`` in a thread (the optimizer step, as the driver runs
  ``_learn`` in a thread), then a fixed-duration weight push inside
  ``PartialRolloutServer.weight_update`` (generation paused: interrupted in ``async``, drained
  in ``one_step_off``).

The schedule is the real :class:`agentloop_trainer.stages.async_buffer.StalenessBuffer` with a producer
and a consumer that mirror :class:`agentloop_trainer.stages.async_driver.AsyncDriver` step for step (the
driver itself needs a trainer with a model, a tokenizer and the loop manager, so it is not run
here): the producer starts whole groups while the buffer admits them, the consumer takes a batch,
updates in a thread while the rollout continues, then pushes. ``sync`` is the trainer's sync
path: roll out the whole batch, update, push.

Per mode: trajectories trained per second (over the whole run, last push included), engine idle
fraction (wall time with no engine call in flight), mean sequences decoding (engine
token-seconds / wall: the batch a real engine would have run), staleness of the trained groups
(mean / max, in policy versions) and the share of trained tokens sampled by an older policy,
interrupted engine calls, and generated tokens never trained (rolled out past the last step).

``--real`` instead runs ``agentloop train`` three times (trainer.mode=sync, one_step_off, async;
same steps and seed, the cached SFT checkpoint as the default job) and tabulates wall time,
samples per second, the engine's idle fraction over the training steps, the CPU the command used
(of all cores: on a CPU-only machine the engine and the update share the cores, so the overlap
can only fill what sync leaves unused) and held-out accuracy (with its standard error) from each
run's summary. ``--tool-median-s S`` runs the same job with the calculator slowed by a seeded
log-normal sleep of median ``S`` seconds (``bench/slow_tools.py``; ``--tool-sigma`` its spread),
the wall-clock profile of a search API or a code sandbox, which uses no CPU while it waits.

Run: ``python bench/bench_async.py`` (writes ``bench/results/async.json``);
``python bench/bench_async.py --real [-- overrides]`` (writes ``bench/results/async_real.json``;
with ``--tool-median-s``: ``async_real_slow_tool.json``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import load_average, run_agentloop_train, table, versions, write_result  # noqa: E402

from agentloop_core.partial_rollout import PartialRolloutServer  # noqa: E402
from agentloop_core.protocol import SamplingParams, ServerCapabilities, TokenOutput  # noqa: E402
from agentloop_trainer.stages import Group, StalenessBuffer, staleness_metrics  # noqa: E402

GOAL_SPEEDUP = 1.5


@dataclass(frozen=True)
class Workload:
    """The simulated job (defaults: about 15-25 s per mode on an idle machine)."""

    steps: int = 8
    groups: int = 8
    """GRPO groups per step (data.train_batch_size)."""
    n: int = 4
    """Samples per group."""
    per_token_s: float = 0.002
    turn_tokens: int = 24
    tool_s: float = 0.02
    pareto_alpha: float = 1.2
    max_turns: int = 24
    update_s: float = 0.6
    """The optimizer step (a sleep in a thread)."""
    push_s: float = 0.05
    """The weight push (generation paused meanwhile)."""
    seed: int = 0

    def turns(self, group: int, sample: int) -> int:
        rng = random.Random(f"{self.seed}-{group}-{sample}")
        return min(self.max_turns, int(rng.paretovariate(self.pareto_alpha)))


class AbortableLatencyEngine:
    """``k * per_token_s`` seconds per call of ``k`` tokens, no compute; ``abort`` ends a call
    at the last whole token with the tokens so far (an abort for a request not running is
    ignored, as engines do)."""

    capabilities = ServerCapabilities(logprobs=True)

    def __init__(self, per_token_s: float) -> None:
        self.per_token_s = per_token_s
        self.generated_tokens = 0
        self._running: dict[str, asyncio.Event] = {}

    async def generate(self, request_id: str, prompt_ids: list[int], sampling_params: Any) -> TokenOutput:
        sp = SamplingParams.from_mapping(sampling_params)
        aborted = self._running[request_id] = asyncio.Event()
        start = time.perf_counter()
        try:
            await asyncio.wait_for(aborted.wait(), sp.max_tokens * self.per_token_s)
            k = min(sp.max_tokens, int((time.perf_counter() - start) / self.per_token_s))
            stop = "aborted"
        except asyncio.TimeoutError:
            k, stop = sp.max_tokens, "length"
        finally:
            del self._running[request_id]
        ids = [1 + (len(prompt_ids) + i) % 500 for i in range(k)]
        self.generated_tokens += k
        return TokenOutput(token_ids=ids, log_probs=[-0.5] * k, stop_reason=stop)

    async def abort(self, request_id: str) -> None:
        if request_id in self._running:
            self._running[request_id].set()


class Run:
    """One mode's run: the wrapped engine, the buffer and the counters."""

    def __init__(self, w: Workload, max_staleness: int, interrupt: bool) -> None:
        self.w = w
        self.engine = AbortableLatencyEngine(w.per_token_s)
        self.server = PartialRolloutServer(self.engine, interrupt=interrupt)
        self.buffer = StalenessBuffer(w.groups, max_staleness)
        self.max_staleness = max_staleness
        self.changed = asyncio.Event()
        self.metrics: list[dict[str, float]] = []

    async def trajectory(self, group: int, sample: int) -> None:
        rid = f"train-{group}-{sample}"
        prompt = [7] * 32
        for _ in range(self.w.turns(group, sample)):
            out = await self.server.generate(rid, prompt, {"max_tokens": self.w.turn_tokens, "logprobs": True})
            prompt = prompt + out.token_ids + [9] * 6  # the tool's reply, appended as ids
            await asyncio.sleep(self.w.tool_s)

    async def roll(self, group: Group) -> None:
        """One group's samples, their per-token versions from the ledger (as the driver)."""
        rids = [f"train-{group.index}-{k}" for k in range(self.w.n)]
        self.server.track(rids)
        try:
            await asyncio.gather(*(self.trajectory(group.index, k) for k in range(self.w.n)))
        finally:
            ledgers = [self.server.pop_ledger(r) for r in rids]
        for _, vs in ledgers:
            group.token_versions.update(vs)
        self.buffer.finish(group, None)
        self.changed.set()

    async def update(self, step: int, groups: list[Group]) -> None:
        """The update in a thread, then the push with generation paused; the step's metrics."""
        await asyncio.to_thread(time.sleep, self.w.update_s)
        async with self.server.weight_update(policy_version=step + 1):
            await asyncio.sleep(self.w.push_s)
        self.changed.set()
        self.metrics.append(staleness_metrics(step, groups, self.max_staleness))

    async def run_sync(self) -> None:
        for step in range(self.w.steps):
            groups = [self.buffer.start(self.server.policy_version) for _ in range(self.w.groups)]
            await asyncio.gather(*(self.roll(g) for g in groups))
            await self.update(step, self.buffer.take())

    async def run_async(self) -> None:
        tasks: set[asyncio.Task] = set()

        async def produce() -> None:
            while True:
                if not self.buffer.can_start(self.server.policy_version) or self.server.paused:
                    self.changed.clear()
                    await self.changed.wait()
                    continue
                group = self.buffer.start(self.server.policy_version)
                task = asyncio.get_running_loop().create_task(self.roll(group))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
                await asyncio.sleep(0)

        producer = asyncio.get_running_loop().create_task(produce())
        try:
            for step in range(self.w.steps):
                while not self.buffer.ready():
                    self.changed.clear()
                    await self.changed.wait()
                groups = self.buffer.take()
                self.changed.set()
                await self.update(step, groups)
        finally:
            for t in (producer, *tasks):
                t.cancel()
            await asyncio.gather(producer, *tasks, return_exceptions=True)


MODES = [  # name, max_staleness, interrupt
    ("sync", 0, False),
    ("one_step_off", 1, False),
    ("async (max_staleness 1)", 1, True),
    ("async (max_staleness 2)", 2, True),
]


def measure(w: Workload, name: str, max_staleness: int, interrupt: bool) -> dict[str, Any]:
    async def main() -> dict[str, Any]:
        run = Run(w, max_staleness, interrupt)
        start = time.perf_counter()
        await (run.run_sync() if name == "sync" else run.run_async())
        wall = time.perf_counter() - start
        trained_tokens = lags = 0
        for m in run.metrics:
            for key, v in m.items():
                if key.startswith("staleness/tokens_lag_"):
                    trained_tokens += v
                    lags += v * (int(key.rsplit("_", 1)[1]) > 0)
        return {
            "mode": name, "max_staleness": max_staleness, "interrupt": interrupt,
            "wall_seconds": round(wall, 2),
            "trajectories_per_second": w.steps * w.groups * w.n / wall,
            "engine_idle_fraction": 1.0 - min(1.0, run.server.busy_seconds() / wall),
            "mean_sequences_decoding": run.engine.generated_tokens * w.per_token_s / wall,
            "staleness_mean": sum(m["staleness/mean"] for m in run.metrics) / len(run.metrics),
            "staleness_max": max(m["staleness/max"] for m in run.metrics),
            "old_policy_token_share": lags / trained_tokens if trained_tokens else 0.0,
            "interrupted_calls": run.server.stats["interrupted_calls"],
            "untrained_tokens": int(run.engine.generated_tokens - trained_tokens),
            "trained_tokens": int(trained_tokens),
        }

    return asyncio.run(main())


def simulated(args: argparse.Namespace) -> None:
    w = Workload(steps=args.steps, groups=args.groups, n=args.n, update_s=args.update_s)
    load_start = load_average()
    turns = [w.turns(g, k) for g in range(w.steps * w.groups) for k in range(w.n)]
    print(f"load average at start {load_start}; turns per trajectory: mean {sum(turns) / len(turns):.1f}, "
          f"max {max(turns)} (Pareto alpha {w.pareto_alpha}, cap {w.max_turns}); driver: StalenessBuffer + "
          "PartialRolloutServer with a producer/consumer mirroring AsyncDriver (not the driver itself)", flush=True)
    results = [measure(w, *mode) for mode in MODES]
    base = results[0]["trajectories_per_second"]
    rows = [[r["mode"], f"{r['wall_seconds']:.1f}", f"{r['trajectories_per_second']:.1f}",
             f"{r['trajectories_per_second'] / base:.2f}x", f"{r['engine_idle_fraction']:.2f}",
             f"{r['mean_sequences_decoding']:.1f}", f"{r['staleness_mean']:.2f} / {r['staleness_max']:.0f}",
             f"{r['old_policy_token_share']:.2f}", r["interrupted_calls"], r["untrained_tokens"]]
            for r in results]
    load_end = load_average()
    text = table(
        ["mode", "wall s", "traj/s", "vs sync", "engine idle", "seqs decoding", "staleness mean / max",
         "old-policy tokens", "interrupted calls", "untrained tokens"], rows,
        title=f"Long-tail workload, {w.steps} steps x {w.groups} groups x {w.n} samples, update {w.update_s} s "
              f"+ push {w.push_s} s, {w.per_token_s * 1e3:.0f} ms/token, load {load_start} -> {load_end}")
    best = max(r["trajectories_per_second"] for r in results[1:]) / base
    verdict = f"goal >= {GOAL_SPEEDUP}x throughput vs sync: {'met' if best >= GOAL_SPEEDUP else 'missed'} ({best:.2f}x)"
    print(verdict)
    write_result("async", {
        "description": __doc__.split("``--real``")[0].strip(), "load_average_at_start": load_start,
        "workload": w.__dict__, "results": results, "goal": verdict, "table_markdown": text,
        "versions": versions("agentloop-core", "agentloop-trainer"),
    })


def _children_cpu_seconds() -> float:
    import resource

    usage = resource.getrusage(resource.RUSAGE_CHILDREN)  # finished (waited-for) children only
    return usage.ru_utime + usage.ru_stime


def _engine_idle(steps: list[dict[str, Any]]) -> float:
    """The fraction of the training steps' wall time with no engine call in flight (each
    step's ``rollout/engine_idle_fraction``, weighted by its wall time; measured alike in every
    mode: sync wraps the engine in ``BusyTimeServer``, the async modes ask the partial-rollout
    wrapper)."""
    wall = sum(m["timing_s/step"] for m in steps)
    return sum(m["rollout/engine_idle_fraction"] * m["timing_s/step"] for m in steps) / max(wall, 1e-9)


def real(args: argparse.Namespace) -> None:
    """``agentloop train`` once per mode (the cached SFT checkpoint, as the default job)."""
    load_start = load_average()
    results = []
    overrides, env, tool = list(args.overrides), None, None
    if args.tool_median_s is not None:
        tool = {"median_s": args.tool_median_s, "sigma": args.tool_sigma}
        overrides.append(f"actor_rollout_ref.rollout.multi_turn.function_tool_path={Path(__file__).parent / 'slow_tools.py'}")
        env = {"AGENTLOOP_BENCH_TOOL_MEDIAN_S": str(args.tool_median_s), "AGENTLOOP_BENCH_TOOL_SIGMA": str(args.tool_sigma)}
    for mode in ("sync", "one_step_off", "async"):
        work = Path(tempfile.mkdtemp(prefix=f"agentloop-async-{mode}-"))
        cpu_before = _children_cpu_seconds()
        summary, wall = run_agentloop_train(work, [f"trainer.mode={mode}", *overrides], env=env, label=f"({mode}) ")
        cpu = _children_cpu_seconds() - cpu_before
        steps = [json.loads(line) for line in next(work.rglob("metrics.jsonl")).read_text().splitlines()]
        steps = [m for m in steps if "rollout/num_samples" in m]
        samples = sum(m["rollout/num_samples"] for m in steps)
        acc, held_out = summary["eval_accuracy_after"], summary["held_out_size"]
        results.append({
            "mode": mode, "command_seconds": round(wall, 1), "grpo_seconds": round(summary["wall_seconds"], 1),
            "steps": summary["steps"], "samples": int(samples),
            "samples_per_second": samples / summary["wall_seconds"],
            "engine_idle_fraction": _engine_idle(steps),
            "cpu_utilisation": cpu / (wall * (os.cpu_count() or 1)),
            "eval_accuracy_before": summary["eval_accuracy_before"], "eval_accuracy_after": acc,
            "eval_standard_error": math.sqrt(acc * (1 - acc) / held_out) if held_out else None,
            "held_out_size": held_out, "run_dir": str(work),
        })
    base = results[0]["samples_per_second"]
    rows = [[r["mode"], f"{r['command_seconds']:.0f}", f"{r['grpo_seconds']:.0f}", r["samples"],
             f"{r['samples_per_second']:.2f}", f"{r['samples_per_second'] / base:.2f}x",
             f"{r['engine_idle_fraction']:.2f}", f"{r['cpu_utilisation']:.0%}",
             f"{r['eval_accuracy_before']:.3f}", f"{r['eval_accuracy_after']:.3f} ± {r['eval_standard_error']:.3f}"]
            for r in results]
    load_end = load_average()
    text = table(["mode", "command s", "GRPO s (evals included)", "samples", "samples/s", "vs sync",
                  "engine idle (training steps)", "CPU used (of all cores)", "held-out before",
                  "held-out after ± s.e."], rows,
                 title=f"agentloop train per trainer.mode, overrides {args.overrides or 'none'}, "
                       + (f"calculator slowed by a log-normal sleep (median {tool['median_s']} s, sigma "
                          f"{tool['sigma']}), " if tool else "")
                       + f"load {load_start} -> {load_end}")
    write_result("async_real_slow_tool" if tool else "async_real", {
        "description": "agentloop train with trainer.mode=sync|one_step_off|async, same overrides and seed; "
                       "samples/s over the GRPO wall time (evals included)",
        "slow_tool": tool,
        "load_average_at_start": load_start, "overrides": args.overrides, "results": results,
        "table_markdown": text, "versions": versions("torch", "transformers", "agentloop-trainer"),
    })


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--real", action="store_true", help="run agentloop train per mode instead")
    parser.add_argument("--steps", type=int, default=Workload.steps)
    parser.add_argument("--groups", type=int, default=Workload.groups)
    parser.add_argument("--n", type=int, default=Workload.n)
    parser.add_argument("--update-s", type=float, default=Workload.update_s)
    parser.add_argument("--tool-median-s", type=float, default=None,
                        help="with --real: slow the calculator by a log-normal sleep of this median (seconds)")
    parser.add_argument("--tool-sigma", type=float, default=1.0, help="with --tool-median-s: the log's spread")
    parser.add_argument("overrides", nargs="*", help="with --real: key=value overrides for agentloop train (after --)")
    args = parser.parse_args()
    if args.real:
        real(args)
    else:
        simulated(args)


if __name__ == "__main__":
    main()
