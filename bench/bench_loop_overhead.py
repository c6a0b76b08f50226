"""Benchmark 3: per-turn framework cost of the tool agent loop, with a zero-latency engine.

Every trajectory makes 3 calculator calls and then answers (4 generate calls). The engine is
a scripted stand-in that returns the tokenizer-encoded reply at once, the calculator answers
at once, so the wall time is the framework's own cost: rendering, delta tokenization, parsing,
tool dispatch, output assembly. One process pinned to one core, ``OMP_NUM_THREADS=1``.

* ours: ``AgentLoopWorker`` + ``tool_agent`` (``agentloop_tools.ToolAgentLoop``) over
  ``agentloop_core.testing.ScriptedServer``; tool = the built-in ``calculator`` function tool.
* verl 0.9.1: ``verl.experimental.agent_loop.tool_agent_loop.ToolAgentLoop`` in the same
  process, driven by a stand-in server manager that returns the same scripted ids (see
  ``verl_driver.py``); tool = a verl ``BaseTool`` that evaluates the same expression.

Run: ``python bench/bench_loop_overhead.py`` (writes ``bench/results/loop_overhead.json``).
``--full-check`` adds a row with the check as it was before #35 (one re-encode of the whole
trajectory, ``Trajectory._full_check``) next to the turn-by-turn one. ``--profile`` adds one cProfile run of our side only (after the timed rounds, so it does not
slow them), prints the top functions by cumulative and by own time and stores the top entries
under ``profile_ours`` in the result file.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import load_average, pin_one_core, table, versions, write_result  # noqa: E402
from tool_engine import calculator_turns  # noqa: E402

TOOL_CALLS = 3
SHORT_FILLER = "Let me use the calculator. "


def scripted_reply(tok):
    """``(request_id, prompt_ids, call_index) -> ids`` for ScriptedServer and the verl stand-in."""
    text_for = calculator_turns(TOOL_CALLS, filler=SHORT_FILLER)
    cache: dict[int, list[int]] = {}

    def reply(request_id: str, prompt_ids: list[int], index: int) -> list[int]:
        if index not in cache:
            cache[index] = tok.encode(text_for(request_id, index), add_special_tokens=False)
        return cache[index]

    return reply


def prompts(n: int) -> list[list[dict]]:
    return [[{"role": "user", "content": f"What is ({i % 7 + 2} + 5) * 3? Use the calculator."}] for i in range(n)]


async def run_ours(n: int, repeats: int, profiler=None, sanity_check: str = "strict", full_check: bool = False) -> dict:
    from agentloop_core import AgentLoopWorker
    from agentloop_core.testing import ScriptedServer
    from agentloop_core.testing.tiny_tokenizer import load_tiny_tokenizer
    from agentloop_core.tokenization import Trajectory
    from agentloop_tools import calculator

    tok = load_tiny_tokenizer()
    rows = [{"raw_prompt": p, "request_id": f"t{i}"} for i, p in enumerate(prompts(n))]
    walls = []
    for _ in range(repeats + 1):  # the first run warms caches and is dropped
        server = ScriptedServer(scripted_reply(tok), eos_token_id=tok.eos_token_id, append_eos=True)
        worker = AgentLoopWorker(server, tok, {
            "default_agent_loop": "tool_agent", "sampling_params": {"max_tokens": 256, "logprobs": True},
            "tools": {"calculator": calculator}, "response_length": 2048, "sanity_check": sanity_check})
        profiling = profiler is not None and bool(walls)  # never the warm-up run
        if profiling:
            profiler.enable()
        turn_by_turn = Trajectory._unchanged_since_rendered
        if full_check:  # the check before #35: every trajectory takes the full re-encode
            Trajectory._unchanged_since_rendered = lambda self, built: False
        try:
            start = time.perf_counter()
            outs = await worker.generate_sequences(rows)
            walls.append(time.perf_counter() - start)
        finally:
            Trajectory._unchanged_since_rendered = turn_by_turn
        if profiling:
            profiler.disable()
        calls = [o.metrics.get("tool_calls") for o in outs]
        if calls != [TOOL_CALLS] * n:
            raise RuntimeError(f"expected {TOOL_CALLS} tool calls per trajectory, got {sorted(set(map(str, calls)))}: "
                               f"{outs[0].metrics}")
    return summarize(walls[1:], n)


def profile_ours(n: int, top: int) -> dict:
    """One cProfile run of our loop (a warm-up run first, as in the timed rounds).

    Args:
        n: Trajectories in the profiled run.
        top: How many functions to print and keep per sort order.

    Returns:
        ``{"total_s", "by_cumulative", "by_own_time"}``; each list entry names the function and
        gives its calls, own and cumulative seconds and its share of the profiled total.
    """
    import cProfile
    import io
    import pstats

    profiler = cProfile.Profile()
    asyncio.run(run_ours(n, 1, profiler))
    stats = pstats.Stats(profiler)
    total = stats.total_tt
    out: dict = {"total_s": total}
    for key, label in (("cumulative", "by_cumulative"), ("tottime", "by_own_time")):
        buffer = io.StringIO()
        pstats.Stats(profiler, stream=buffer).sort_stats(key).print_stats(top)
        print(f"--- our loop, top {top} by {key} (profiled total {total:.2f} s) ---")
        print(buffer.getvalue().split("\n\n", 2)[-1].rstrip())
        rows = sorted(stats.stats.items(), key=lambda item: item[1][3 if key == "cumulative" else 2], reverse=True)
        out[label] = [{"function": f"{Path(file).name}:{line}({name})", "calls": nc,
                       "own_s": round(tt, 4), "cum_s": round(ct, 4),
                       "share": round((ct if key == "cumulative" else tt) / total, 3)}
                      for (file, line, name), (_, nc, tt, ct, _) in rows[:top]]
    return out


def summarize(walls: list[float], n: int) -> dict:
    wall = statistics.median(walls)
    return {"trajectories": n, "walls_s": walls, "median_wall_s": wall, "trajectories_per_s": n / wall,
            "ms_per_tool_turn": 1e3 * wall / (n * TOOL_CALLS),
            "ms_per_generate_turn": 1e3 * wall / (n * (TOOL_CALLS + 1))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trajectories", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--skip-verl", action="store_true")
    parser.add_argument("--full-check", action="store_true",
                        help="also time ours with the full re-encode check (before #35)")
    parser.add_argument("--profile", action="store_true",
                        help="also cProfile one run of our loop; top entries go to profile_ours")
    parser.add_argument("--profile-top", type=int, default=25)
    args = parser.parse_args()
    cpu = pin_one_core()
    load_start = load_average()
    # Alternate ours and verl round by round so a change in machine load hits both alike.
    # The unchecked row is the like-for-like one: verl's loop does not re-tokenize to check the
    # ids it trains on; ours does by default (sanity_check=strict).
    ours_unchecked = "ours, sanity_check=disable (no re-tokenization check, as verl)"
    walls: dict[str, list[float]] = {"ours (agentloop tool_agent)": [], ours_unchecked: []}
    ours_full = "ours, full re-encode check (before #35)"
    if args.full_check:
        walls[ours_full] = []
    verl_note = "skipped: --skip-verl" if args.skip_verl else None
    verl_run = None
    if not args.skip_verl:
        try:
            import verl_driver

            verl_run = verl_driver.run
            walls["verl 0.9.1 ToolAgentLoop"] = []
        except ImportError as exc:
            verl_note = (f"verl could not be imported ({exc}); install it in the bench venv with "
                         "`pip install verl==0.9.1 cachetools uvicorn fastapi torch==2.13.0`")
    for _ in range(args.repeats):
        walls["ours (agentloop tool_agent)"] += asyncio.run(run_ours(args.trajectories, 1))["walls_s"]
        walls[ours_unchecked] += asyncio.run(run_ours(args.trajectories, 1, sanity_check="disable"))["walls_s"]
        if args.full_check:
            walls[ours_full] += asyncio.run(run_ours(args.trajectories, 1, full_check=True))["walls_s"]
        if verl_run is not None:
            try:
                walls["verl 0.9.1 ToolAgentLoop"] += asyncio.run(verl_run(args.trajectories, 1, summarize))["walls_s"]
            except Exception as exc:  # noqa: BLE001 - report why the peer did not run, keep our numbers
                verl_note = f"verl run failed: {type(exc).__name__}: {exc}\n{traceback.format_exc()[-1500:]}"
                verl_run = None
                walls.pop("verl 0.9.1 ToolAgentLoop", None)
    results = {name: summarize(w, args.trajectories) for name, w in walls.items()}
    rows = [(name, round(r["trajectories_per_s"], 1), round(r["ms_per_tool_turn"], 2),
             round(r["ms_per_generate_turn"], 2)) for name, r in results.items()]
    if verl_note:
        rows.append(("verl 0.9.1 ToolAgentLoop", "n/a", "n/a", "n/a"))
        print("verl:", verl_note)
    text = table(["loop", "trajectories/s (1 core)", "ms per tool turn", "ms per generate call"], rows,
                 title=f"Loop overhead: {args.trajectories} trajectories x {TOOL_CALLS} tool calls, "
                       "zero-latency scripted engine and tool, one core")
    payload = {"description": __doc__.split("Run:")[0].strip(), "load_average_at_start": load_start,
               "pinned_cpu": cpu, "versions": versions("transformers", "verl"), "results": results,
               "verl_note": verl_note, "table_markdown": text}
    if "verl 0.9.1 ToolAgentLoop" in results:
        ours, unchecked, verl = (results[k] for k in ("ours (agentloop tool_agent)", ours_unchecked,
                                                      "verl 0.9.1 ToolAgentLoop"))
        payload["ours_over_verl_throughput"] = ours["trajectories_per_s"] / verl["trajectories_per_s"]
        payload["ours_over_verl_cost_per_tool_turn"] = ours["ms_per_tool_turn"] / verl["ms_per_tool_turn"]
        payload["unchecked_over_verl_cost_per_tool_turn"] = unchecked["ms_per_tool_turn"] / verl["ms_per_tool_turn"]
        payload["goal"] = "cost per tool turn at most 0.5x verl's"
        print(f"ours / verl cost per tool turn: {payload['ours_over_verl_cost_per_tool_turn']:.2f} "
              f"(unchecked: {payload['unchecked_over_verl_cost_per_tool_turn']:.2f}); goal <= 0.5")
    if args.profile:
        payload["profile_ours"] = profile_ours(args.trajectories, args.profile_top)
    write_result("loop_overhead", payload)


if __name__ == "__main__":
    main()
