"""Benchmark (issue 20, goal 3): how many concurrent trajectories one rollout process drives.

One process runs N = 256, 1024, 4096 and 16384 multi-turn trajectories at once against a latency-only
engine (``latency_engine.LatencyOnlyEngine``: the scripted reply after a fixed delay per token,
``asyncio.sleep``, no compute), so what is measured is the framework and its event loop. Every
trajectory makes 3 calculator calls and then answers (4 generate calls, the same script as
``bench_loop_overhead.py``).

* ours: ``agentloop_core.AgentLoopWorker.generate_sequences`` (the in-process rollout worker,
  one asyncio task per sample) running the real ``tool_agent`` loop with the built-in
  ``calculator`` tool, default config (``turns_per_loop_iteration=4``: at most 4 turns resume
  per event-loop iteration, see ``agentloop_core.runtime.pacing.TurnPacer``; ``switch_interval_s=0.002``,
  see ``agentloop_core.runtime.switch_interval``).
* ours unpaced: the same with ``turns_per_loop_iteration=None`` (the worker before the pacer).
* ours with Python's GC: the same with ``hold_full_gc=False`` (full garbage collections run on
  Python's schedule during the batch, as before issue 35).
* ours with Python's switch interval: the same with ``switch_interval_s=None`` (the GIL changes
  hands every 5 ms, Python's default, instead of the worker's 2 ms while a batch is in flight:
  the calculator's pool threads then get the GIL from the busy loop only every 5 ms).
* ours with a pooled tool: the same with the calculator in a thread pool of its own, as every
  sync function tool runs by default (the built-in calculator runs on the event loop, ``inline``).
* verl 0.9.1: ``verl.experimental.agent_loop.tool_agent_loop.ToolAgentLoop``, one loop object
  per sample as verl's worker builds them, all awaited with ``asyncio.gather`` (as in
  ``verl_driver.py``); the calculator as a verl function tool; the same engine behind verl's
  ``server_manager`` interface. Neither side pads the outputs into tensors.

Per run: trajectories per second (N / time until the last one finished); event-loop lag (a
probe task sleeps 10 ms in a loop and records how late it wakes: p50/p99/max; the longest
full (generation-2) garbage collection is reported beside it, since it stops the loop too); peak memory per
trajectory ((peak RSS - RSS just before the batch) / N, outputs included, as a worker holds
them until it returns); process CPU time over the batch (the engine computes nothing, so this
is the framework, asyncio and the probe). Every (side, N) runs in a fresh subprocess, so memory
high-water marks and allocator state do not carry over; the sides alternate at each N. An
8-trajectory warm-up runs first in each process and is not measured. Then ours runs once more
at the highest N under cProfile (a separate run: cProfile slows it down) for where the time goes.

Before/after a change in one run: ``--baseline-tree DIR`` adds a side that imports the packages
in DIR first (a copy of the code before the change), run alternately with ours at each N under
the same load, and ``--rounds K`` runs each side K times (the table shows each side's median run
by CPU per trajectory, the primary measure on a shared machine).

Run: ``python bench/bench_scale.py`` (writes ``bench/results/scale.json``); verl's side needs
verl installed (``nox -s bench``'s venv).
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import gc
import importlib.util
import json
import os
import pstats
import resource
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import REPO_ROOT, load_average, table, versions, write_result  # noqa: E402
from bench_loop_overhead import TOOL_CALLS, prompts, scripted_reply  # noqa: E402
from latency_engine import LatencyOnlyEngine  # noqa: E402

LEVELS = (256, 1024, 4096, 16384)
PROBE_S = 0.010
WARMUP = 8
RESULT_PREFIX = "SCALE_RESULT "
SIDES = {"ours": "ours (agentloop tool_agent)", "ours_unpaced": "ours, turns_per_loop_iteration=None",
         "ours_python_gc": "ours, hold_full_gc=false", "ours_python_switch": "ours, switch_interval_s=null",
         "ours_pooled_tool": "ours, the calculator in a thread pool (not inline)",
         "ours_baseline": "ours, baseline tree (--baseline-tree)",
         "verl": "verl 0.9.1 ToolAgentLoop"}


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (``q`` in 0..100); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered) + 0.5) - 1))]


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


async def lag_probe(lags: list[float], stop: asyncio.Event) -> None:
    """Sleep ``PROBE_S`` in a loop and record how late each wake-up is, in seconds."""
    while not stop.is_set():
        start = time.perf_counter()
        await asyncio.sleep(PROBE_S)
        lags.append(time.perf_counter() - start - PROBE_S)


def gc_pause_recorder(pauses: list[float]) -> Callable[[str, dict], None]:
    """A ``gc.callbacks`` hook appending the seconds of each generation-2 collection."""
    started = [0.0]

    def hook(phase: str, info: dict) -> None:
        if info.get("generation") != 2:
            return
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            pauses.append(time.perf_counter() - started[0])

    return hook


async def measure(batch: Callable[[], Awaitable[list]], n: int, profile: bool) -> tuple[dict, list]:
    """Run ``batch()`` (N trajectories at once) with the lag probe beside it."""
    gc.collect()
    pauses: list[float] = []
    hook = gc_pause_recorder(pauses)
    gc.callbacks.append(hook)
    rss_before = rss_mb()
    lags: list[float] = []
    stop = asyncio.Event()
    probe = asyncio.create_task(lag_probe(lags, stop))
    await asyncio.sleep(0)
    profiler = cProfile.Profile() if profile else None
    cpu_start, start = cpu_s(), time.perf_counter()
    if profiler:
        profiler.enable()
    outs = await batch()
    if profiler:
        profiler.disable()
    wall, cpu = time.perf_counter() - start, cpu_s() - cpu_start
    gc.callbacks.remove(hook)
    stop.set()
    await probe
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # kB on Linux
    lags_ms = [1e3 * x for x in lags]
    result = {
        "trajectories": n, "wall_s": wall, "trajectories_per_s": n / wall, "cpu_s": cpu,
        "cpu_ms_per_trajectory": 1e3 * cpu / n, "cpu_utilisation": cpu / wall,
        "lag_samples": len(lags_ms), "lag_p50_ms": percentile(lags_ms, 50), "lag_p99_ms": percentile(lags_ms, 99),
        "lag_max_ms": max(lags_ms, default=None), "gc_full_collections": len(pauses),
        "gc_full_max_ms": 1e3 * max(pauses, default=0.0), "gc_full_total_ms": 1e3 * sum(pauses),
        "rss_before_mb": rss_before, "peak_rss_mb": peak_mb,
        "kb_per_trajectory": 1024 * max(0.0, peak_mb - rss_before) / n,
    }
    if profiler:
        result["profile"] = profile_summary(profiler)
    return result, outs


# Steps of one trajectory on our side: (label, file suffix, function); cumulative time of each.
PHASES = (
    ("worker: one sample, end to end", "runtime/worker.py", "one"),
    ("ToolAgentLoop.__init__ (one loop object per sample)", "agentloop_tools/agent_loop.py", "__init__"),
    ("  of which the stop token ids (cached per tokenizer)", "agentloop_tools/per_tokenizer.py", "stop_token_ids"),
    ("Trajectory(): render + encode the prompt", "tokenization/trajectory.py", "__init__"),
    ("after generate: decode + parse the tool call", "agentloop_tools/agent_loop.py", "_after_generate"),
    ("run the calculator (sync tool thread pool)", "agentloop_tools/agent_loop.py", "_run_tools"),
    ("append tool messages (delta render + encode)", "agentloop_tools/agent_loop.py", "_append"),
    ("to_output (final output record)", "tokenization/trajectory.py", "to_output"),
    ("  of which sanity_check (re-render + re-encode the whole trajectory)", "tokenization/trajectory.py",
     "sanity_check"),
    ("chat template rendering (apply_chat_template, all callers)", "tokenization_utils_base.py", "apply_chat_template"),
    ("tokenizer encode (all callers)", "tokenization_utils_base.py", "encode"),
)


def profile_summary(profiler: cProfile.Profile, top: int = 25) -> dict:
    """Top functions by own time and by cumulative time, own time summed per package, and the
    cumulative time of each step of a trajectory (``PHASES``)."""
    stats = pstats.Stats(profiler)
    rows = []
    by_area: dict[str, float] = {}
    phases: dict[str, float] = {}
    for (filename, line, func), (_cc, ncalls, tottime, cumtime, _callers) in stats.stats.items():  # type: ignore[attr-defined]
        where = f"{filename}:{line}({func})"
        rows.append({"function": where, "ncalls": ncalls, "tottime_s": round(tottime, 3),
                     "cumtime_s": round(cumtime, 3)})
        area = area_of(filename, func)
        by_area[area] = by_area.get(area, 0.0) + tottime
        for label, suffix, name in PHASES:
            if func == name and filename.endswith(suffix):
                phases[label] = phases.get(label, 0.0) + cumtime
    idle = by_area.pop(IDLE, 0.0)
    total = sum(by_area.values()) or 1.0
    return {
        "total_own_time_s": round(total, 2), "idle_s": round(idle, 2),
        "note": "shares are of the profiled time spent working (idle epoll waits excluded)",
        "own_time_share_by_area": {k: round(v / total, 3) for k, v in sorted(by_area.items(), key=lambda kv: -kv[1])},
        "cumulative_share_by_step": {label: round(phases[label] / total, 3) for label, *_ in PHASES if label in phases},
        "top_by_own_time": sorted(rows, key=lambda r: -r["tottime_s"])[:top],
        "top_by_cumulative_time": sorted(rows, key=lambda r: -r["cumtime_s"])[:top],
    }


AREAS = (("agentloop_core/runtime", "agentloop runtime (worker)"), ("agentloop_core/tokenization", "agentloop tokenization"),
         ("agentloop_core", "agentloop core (other)"), ("agentloop_tools", "agentloop tools + tool_agent loop"),
         ("jinja2", "jinja2 (chat template)"), ("<template>", "jinja2 (chat template)"),
         ("transformers", "transformers (tokenizer wrapper)"), ("asyncio", "asyncio event loop"),
         ("json", "json (tool schema tojson, tool-call parsing)"), ("concurrent", "threads (sync tool pool)"),
         ("threading", "threads (sync tool pool)"), ("queue", "threads (sync tool pool)"),
         ("latency_engine", "benchmark engine"), ("verl", "verl"))


IDLE = "idle (waiting in epoll)"


def area_of(filename: str, func: str) -> str:
    if filename == "~":
        if "select.epoll" in func:
            return IDLE
        if "tokenizers." in func:
            return "tokenizers (Rust encode/decode/get_vocab)"
        return "other builtins (C)"
    return next((label for key, label in AREAS if f"/{key}/" in filename or filename.endswith(f"/{key}.py")
                 or filename.startswith(key)), "other python")


# -- the two sides, each in its own process ------------------------------------------------------

# The worker config each of our sides overrides.
OURS_OVERRIDES: dict[str, dict[str, Any]] = {
    "ours": {}, "ours_unpaced": {"turns_per_loop_iteration": None}, "ours_python_gc": {"hold_full_gc": False},
    "ours_python_switch": {"switch_interval_s": None}, "ours_pooled_tool": {"calculator_inline": False}}


async def child_ours(n: int, per_token_s: float, profile: bool, overrides: dict[str, Any] | None = None) -> dict:
    from agentloop_core import AgentLoopWorker
    from agentloop_core.protocol import TokenOutput
    from agentloop_core.testing.tiny_tokenizer import load_tiny_tokenizer
    from agentloop_tools import calculator

    overrides = dict(overrides or {})
    tool = calculator
    if not overrides.pop("calculator_inline", True):  # the calculator in its own thread pool, as before
        from agentloop_tools import FunctionTool

        tool = FunctionTool(calculator.fn, name="calculator")
    tok = load_tiny_tokenizer()
    engine = LatencyOnlyEngine(scripted_reply(tok), tok.eos_token_id, per_token_s, TokenOutput)
    worker = AgentLoopWorker(engine, tok, {
        "default_agent_loop": "tool_agent", "sampling_params": {"max_tokens": 256, "logprobs": True},
        "tools": {"calculator": tool}, "response_length": 2048, **overrides})

    def rows(count: int, prefix: str) -> list[dict]:
        return [{"raw_prompt": p, "request_id": f"{prefix}{i}"} for i, p in enumerate(prompts(count))]

    await worker.generate_sequences(rows(WARMUP, "warm"))
    engine.generated_tokens = 0
    result, outs = await measure(lambda: worker.generate_sequences(rows(n, "t")), n, profile)
    calls = {o.metrics.get("tool_calls") for o in outs}
    if calls != {TOOL_CALLS} or len(outs) != n:
        raise RuntimeError(f"expected {n} trajectories with {TOOL_CALLS} tool calls each, got {len(outs)} "
                           f"with {sorted(map(str, calls))}: {outs[0].metrics}")
    return {**result, "engine_tokens_per_trajectory": engine.generated_tokens / n}


async def child_verl(n: int, per_token_s: float, profile: bool) -> dict:
    import verl_driver
    from omegaconf import OmegaConf
    from verl.experimental.agent_loop.agent_loop import DictConfigWrap, ToolListWrap  # pyright: ignore[reportMissingImports]
    from verl.experimental.agent_loop.tool_agent_loop import ToolAgentLoop  # pyright: ignore[reportMissingImports]
    from verl.tools.function_tool import FUNCTION_TOOL_REGISTRY  # pyright: ignore[reportMissingImports]
    from verl.workers.rollout.replica import TokenOutput  # pyright: ignore[reportMissingImports]

    from agentloop_core.testing.tiny_tokenizer import load_tiny_tokenizer

    # The loop-overhead driver's own run is the warm-up; it also registers the calculator as a
    # verl function tool, which is the tool used below.
    await verl_driver.run(WARMUP, 0, lambda walls, count: None)
    tool = FUNCTION_TOOL_REGISTRY["calculator"]
    tok = load_tiny_tokenizer()
    engine = LatencyOnlyEngine(scripted_reply(tok), tok.eos_token_id, per_token_s, TokenOutput, "completed")
    trainer_config = DictConfigWrap(verl_driver._config(2048))
    data_config = DictConfigWrap(OmegaConf.create({"apply_chat_template_kwargs": {}}))
    sampling = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_tokens": 256, "logprobs": True}

    async def one(messages: list[dict]) -> Any:
        loop = ToolAgentLoop(trainer_config=trainer_config, server_manager=engine, tokenizer=tok, processor=None,
                             dataset_cls=None, data_config=data_config, hf_model_type="qwen2",
                             tools=ToolListWrap([tool]))
        return await loop.run(dict(sampling), raw_prompt=messages)

    async def batch() -> list:
        return list(await asyncio.gather(*(one(p) for p in prompts(n))))

    result, outs = await measure(batch, n, profile)
    turns = {o.num_turns for o in outs}
    if turns != {2 * TOOL_CALLS + 2} or len(outs) != n:  # user + 4 assistant + 3 tool turns
        raise RuntimeError(f"verl: expected {n} trajectories of {2 * TOOL_CALLS + 2} turns, got {len(outs)} "
                           f"with num_turns={sorted(turns)}")
    return {**result, "engine_tokens_per_trajectory": engine.generated_tokens / n}


def run_child(side: str, n: int, per_token_ms: float, profile: bool, timeout: float,
              baseline_tree: str | None = None) -> dict:
    """Run one measurement in a fresh interpreter; its result, or ``{"error": ...}``. The
    ``ours_baseline`` side imports the packages in ``baseline_tree`` first (the code before a change)."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", side, "--n", str(n),
           "--per-token-ms", str(per_token_ms), *(["--profile"] if profile else [])]
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
    if side == "ours_baseline":
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(baseline_tree), env.get("PYTHONPATH")]))
    try:
        proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f}s"}
    line = next((x for x in proc.stdout.splitlines() if x.startswith(RESULT_PREFIX)), None)
    if proc.returncode != 0 or line is None:
        return {"error": f"exit {proc.returncode}: {(proc.stderr or proc.stdout)[-1500:]}"}
    return json.loads(line[len(RESULT_PREFIX):])


def verl_missing() -> str | None:
    if importlib.util.find_spec("verl") is None:
        return ("verl is not installed in this interpreter; run the benchmark in `nox -s bench`'s venv "
                "(`python3 -m nox -s bench --install-only`, then `.nox/bench/bin/python bench/bench_scale.py`)")
    return None


def median_run(runs: list[dict]) -> dict:
    """The run with the median CPU time per trajectory, with every run under ``rounds`` (one
    error: that error)."""
    good = sorted((r for r in runs if "error" not in r), key=lambda r: r["cpu_ms_per_trajectory"])
    if len(good) < len(runs):
        return next(r for r in runs if "error" in r)
    return {**good[(len(good) - 1) // 2], **({"rounds": runs} if len(runs) > 1 else {})}


def fmt(value: Any, digits: int = 3) -> Any:
    return "n/a" if value is None else round(value, digits) if isinstance(value, float) else value


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--levels", type=int, nargs="*", default=list(LEVELS))
    parser.add_argument("--per-token-ms", type=float, default=20.0,
                        help="simulated decode time per returned token")
    parser.add_argument("--skip-verl", action="store_true")
    parser.add_argument("--sides", nargs="*", choices=sorted(OURS_OVERRIDES), default=list(OURS_OVERRIDES),
                        help="which of our configurations to run (default: all)")
    parser.add_argument("--no-profile", action="store_true")
    parser.add_argument("--baseline-tree", help=(
        "a folder holding the packages' code before a change (e.g. a copy of agentloop_core/ with the old "
        "tokenization/), put first on PYTHONPATH for one more side run alternately with ours at each N: a "
        "before/after comparison under the same load"))
    parser.add_argument("--rounds", type=int, default=1,
                        help="runs of each side at each N, alternating; the table shows each side's median run by CPU")
    parser.add_argument("--child-timeout", type=float, default=300.0)
    parser.add_argument("--child", choices=sorted(SIDES), help=argparse.SUPPRESS)
    parser.add_argument("--n", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--profile", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        if args.child == "verl":
            result = asyncio.run(child_verl(args.n, args.per_token_ms / 1e3, args.profile))
        else:
            result = asyncio.run(child_ours(args.n, args.per_token_ms / 1e3, args.profile,
                                            OURS_OVERRIDES.get(args.child, {})))
        print(RESULT_PREFIX + json.dumps(result), flush=True)
        return

    load_start = load_average()
    verl_note = "skipped: --skip-verl" if args.skip_verl else verl_missing()
    ours_sides = [*(["ours_baseline"] if args.baseline_tree else []), *args.sides]
    sides = ours_sides + ([] if verl_note else ["verl"])
    results: dict[str, dict[str, dict]] = {side: {} for side in SIDES}
    for n in args.levels:
        runs: dict[str, list[dict]] = {side: [] for side in sides}
        for k in range(args.rounds):
            for side in sides:
                print(f"{SIDES[side]}, N={n}, round {k + 1} (load {load_average()})", flush=True)
                run = run_child(side, n, args.per_token_ms, False, args.child_timeout, args.baseline_tree)
                runs[side].append({**run, "load_average": load_average()})
                if "error" in run:
                    print(f"  failed: {run['error']}", flush=True)
                else:
                    print(f"  {run['cpu_ms_per_trajectory']:.3f} ms CPU per trajectory, "
                          f"{run['trajectories_per_s']:.0f} trajectories/s", flush=True)
        for side in sides:
            results[side][str(n)] = median_run(runs[side])
    profile = None
    if not args.no_profile:
        top = max(args.levels)
        print(f"ours under cProfile, N={top} (load {load_average()})", flush=True)
        profile = {"trajectories": top, **run_child("ours", top, args.per_token_ms, True, args.child_timeout)}

    headers = ["loop", "N concurrent", "trajectories/s", "engine-bound trajectories/s", "lag p50 ms",
               "lag p99 ms", "lag max ms", "longest full GC ms", "KB per trajectory", "CPU s", "CPU ms per trajectory"]
    rows = []
    for side in [*ours_sides, "verl"]:
        for n in args.levels:
            r = results[side].get(str(n)) or {"error": verl_note}
            if "error" in r:
                rows.append((SIDES[side], n, *["n/a"] * (len(headers) - 2)))
                continue
            engine_bound = 1 / (r["engine_tokens_per_trajectory"] * args.per_token_ms / 1e3)  # per trajectory, x N
            rows.append((SIDES[side], n, fmt(r["trajectories_per_s"], 1), fmt(engine_bound * n, 0),
                         fmt(r["lag_p50_ms"], 1), fmt(r["lag_p99_ms"], 0), fmt(r["lag_max_ms"], 0),
                         fmt(r["gc_full_max_ms"], 0),
                         fmt(r["kb_per_trajectory"], 1), fmt(r["cpu_s"], 1), fmt(r["cpu_ms_per_trajectory"], 2)))
    text = table(headers, rows, title=f"Scale: N concurrent trajectories x {TOOL_CALLS} tool calls in one process, "
                                      f"latency-only engine ({args.per_token_ms:g} ms per token, no compute)")
    ratios = {}
    for n in args.levels:
        ours, verl = results["ours"].get(str(n), {}), results["verl"].get(str(n), {})
        if "trajectories_per_s" in ours and "trajectories_per_s" in verl:
            ratios[str(n)] = ours["trajectories_per_s"] / verl["trajectories_per_s"]
    both = [n for n in args.levels if str(n) in ratios]
    top = max(args.levels)
    ours_top = results["ours"].get(str(top), {})
    goal = {
        "p99_lag_under_50ms_at_top": (ours_top.get("lag_p99_ms") or float("inf")) < 50,
        "no_pause_over_100ms_at_top": (ours_top.get("lag_max_ms") or float("inf")) < 100,
        "top_level": top,
        "highest_level_both_ran": max(both) if both else None,
        "ours_over_verl_at_that_level": ratios[str(max(both))] if both else None,
    }
    goal["at_least_2x_verl"] = goal["ours_over_verl_at_that_level"] is not None \
        and goal["ours_over_verl_at_that_level"] >= 2
    # Issue 49: at 4096, 75% of the rate the engine alone allows and at most 0.6x verl's memory.
    at_4096, verl_4096 = results["ours"].get("4096", {}), results["verl"].get("4096", {})
    if "trajectories_per_s" in at_4096:
        bound = 4096 / (at_4096["engine_tokens_per_trajectory"] * args.per_token_ms / 1e3)
        goal["engine_bound_share_at_4096"] = at_4096["trajectories_per_s"] / bound
        goal["at_least_75pct_of_engine_bound_at_4096"] = goal["engine_bound_share_at_4096"] >= 0.75
    if "kb_per_trajectory" in at_4096 and "kb_per_trajectory" in verl_4096:
        goal["memory_over_verl_at_4096"] = at_4096["kb_per_trajectory"] / verl_4096["kb_per_trajectory"]
    if args.baseline_tree:  # the same N, alternating under the same load: CPU per trajectory is the measure
        goal["cpu_ours_over_baseline"] = {
            str(n): results["ours"][str(n)]["cpu_ms_per_trajectory"] / results["ours_baseline"][str(n)]["cpu_ms_per_trajectory"]
            for n in args.levels if "cpu_ms_per_trajectory" in results["ours"].get(str(n), {})
            and "cpu_ms_per_trajectory" in results["ours_baseline"].get(str(n), {})}
        print(f"CPU per trajectory, ours / baseline tree, by N: "
              f"{ {k: round(v, 3) for k, v in goal['cpu_ours_over_baseline'].items()} }")
    print(f"ours / verl trajectories per second by N: { {k: round(v, 2) for k, v in ratios.items()} }")
    print(f"goal: p99 lag < 50 ms at {top}: {goal['p99_lag_under_50ms_at_top']}; "
          f"no pause over 100 ms: {goal['no_pause_over_100ms_at_top']}; "
          f">= 2x verl at the highest N both ran: {goal['at_least_2x_verl']}")
    if profile and "profile" in profile:
        shares = profile["profile"]["own_time_share_by_area"]
        print("where ours spends its time under cProfile (share of own time):",
              ", ".join(f"{k} {100 * v:.0f}%" for k, v in list(shares.items())[:8]))
        print("cumulative share by step:", ", ".join(
            f"{k} {100 * v:.0f}%" for k, v in profile["profile"]["cumulative_share_by_step"].items()))
    write_result("scale", {
        "description": (__doc__ or "").split("Run:")[0].strip(), "load_average_at_start": load_start,
        "per_token_ms": args.per_token_ms, "probe_interval_ms": 1e3 * PROBE_S, "tool_calls_per_trajectory": TOOL_CALLS,
        "versions": versions("agentloop-core", "agentloop-tools", "transformers", "verl"),
        "results": {SIDES[s]: results[s] for s in SIDES}, "verl_note": verl_note,
        "ours_over_verl_throughput": ratios, "goal": goal, "profile_ours_at_top": profile, "table_markdown": text,
    })


if __name__ == "__main__":
    main()
