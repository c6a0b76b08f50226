"""A remote HFServer's prefix cache with and without ``POST /forget_session`` (issue 49 item 1's
cache over HTTP).

The worker tells an engine declaring ``capabilities.forget_session`` when each trajectory is
over, so HFServer's per-trajectory prefix cache drops a finished trajectory's last turn instead
of letting it push a live trajectory's entry out. In process that was already so; over HTTP
(``EngineHTTPClient`` to ``agentloop serve``'s app) no route carried the call until the server
listed ``/forget_session`` in ``/health``. This runs the same batch both ways against one
server each, sides alternating:

* ``told``: worker -> ``LLMServerClient`` -> ``EngineHTTPClient`` -> the engine server ->
  ``HFServer``; the client sends ``/forget_session`` for each finished trajectory;
* ``not told``: the same chain with the routing client wrapped to declare no
  ``forget_session`` (what the client did before the route: the server's bound ages entries out).

Every trajectory is two turns (``test_chat``: a prompt with a shared system part, a generated
turn, a fake tool observation, a second generated turn), ``--concurrency`` at a time; the
prefix cache is bounded to ``--cache-entries`` times the first turns of the trajectories in
flight (the tokens it needs to keep every live trajectory's entry). Reported per side: second
turns that reused their first turn's cache (hits) and that did not (misses), evictions,
entries forgotten, prefill tokens computed per trajectory and the batch's wall time.

Run: ``python bench/bench_forget_http.py`` (~1 min on the tiny model; ``--model DIR`` for a
checkpoint folder such as the converted SmolLM2, ~10 min with ``--concurrency 128 --cache-entries
0.75 --rounds 2``); writes ``bench/results/forget_http.json`` (``--out``).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import load_average, table, versions, write_result  # noqa: E402

from agentloop_core.protocol import ServerCapabilities  # noqa: E402
from agentloop_core.server_wrapper import TransparentServerWrapper  # noqa: E402

SYSTEM = ("You are a careful assistant with a calculator tool. Call it for every arithmetic step, read its "
          "result, then answer with the number alone. ") * 3


class NotTold(TransparentServerWrapper):
    """The routing client, declaring no ``forget_session`` (the client before the route)."""

    @property
    def capabilities(self) -> ServerCapabilities:
        return ServerCapabilities(logprobs=True)


async def one_side(told: bool, model: str, args: argparse.Namespace, tokenizer: Any) -> dict[str, Any]:
    import agentloop_core.testing.loops  # noqa: F401  registers test_chat
    from agentloop_core.runtime import AgentLoopWorker
    from agentloop_core.testing.loops import TEST_CHAT_AGENT
    from agentloop_engines import EngineHTTPClient
    from agentloop_engines.adapters.hf import HFServer
    from agentloop_engines.fleet.client import LLMServerClient
    from agentloop_engines.serving.server import ServerThread

    prompt = tokenizer.apply_chat_template(
        [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "question 0000"}],
        add_generation_prompt=True, tokenize=False)
    first_turn = len(tokenizer.encode(prompt, add_special_tokens=False)) + args.max_tokens
    bound = int(args.cache_entries * args.concurrency * first_turn)
    engine = HFServer(model, prefix_cache_tokens=bound, max_batch_size=args.concurrency, seed=0)
    with ServerThread(engine) as thread:
        remote = EngineHTTPClient(thread.url)
        await remote.connect()
        client = LLMServerClient([remote])
        worker = AgentLoopWorker(client if told else NotTold(client), tokenizer, {
            "sampling_params": {"max_tokens": args.max_tokens, "temperature": 1.0, "ignore_eos": True},
            "max_concurrent_samples": args.concurrency, "sampling_seed": 0})
        rows = [{"agent_name": TEST_CHAT_AGENT, "observation": "the tool says 42",
                 "raw_prompt": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"question {i:04d}"}]}
                for i in range(args.trajectories)]
        start = time.perf_counter()
        outputs = await worker.generate_sequences(rows)
        wall = time.perf_counter() - start
        await remote.close()
    failed = sum(o.failed for o in outputs)
    if failed:
        raise RuntimeError(f"{failed} of {len(outputs)} trajectories failed")
    s = engine.stats
    return {"told": told, "wall_s": wall, "cache_tokens_bound": bound, "second_turn_hits": s["prefix_cache_hits"],
            "second_turn_misses": args.trajectories - s["prefix_cache_hits"],
            "evictions": s["prefix_cache_evictions"], "forgotten": s["prefix_cache_forgotten"],
            "entries_left": len(engine.prefix_cache or ()),
            "prefill_tokens_per_trajectory": s["prefill_tokens"] / args.trajectories, "load": load_average()}


def alternate(rounds: int, run: Callable[[bool], dict[str, Any]], shown: Sequence[str]) -> dict[bool, list[dict[str, Any]]]:
    """``rounds`` runs of each side, ``run(told)``, the order flipping every round (not told
    first in the first); each run's ``shown`` values printed as it ends."""
    runs: dict[bool, list[dict[str, Any]]] = {True: [], False: []}
    for k in range(rounds):
        for told in (False, True) if k % 2 == 0 else (True, False):
            result = run(told)
            runs[told].append(result)
            print(f"round {k + 1} {'told' if told else 'not told'}: "
                  + ", ".join(f"{key} {result[key]:.4g}" for key in shown), flush=True)
    return runs


def median(runs: Sequence[dict[str, Any]], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def sides_table(runs: dict[bool, list[dict[str, Any]]], keys: Sequence[str], title: str) -> str:
    """The two sides' medians of ``keys``, one row each."""
    return table(["side", *keys], [[name, *(median(runs[told], key) for key in keys)]
                                   for name, told in (("not told (no route)", False), ("told (/forget_session)", True))],
                 title=title)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="checkpoint folder (default: the built tiny model)")
    parser.add_argument("--trajectories", type=int, default=256)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens generated per turn")
    parser.add_argument("--cache-entries", type=float, default=1.5,
                        help="the cache bound, in first turns of the trajectories in flight")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default="forget_http", help="results/<out>.json")
    args = parser.parse_args()

    import torch
    from transformers import AutoTokenizer

    torch.set_num_threads(args.threads)
    if args.model is None:
        from agentloop_engines.testing.tiny_model import build_tiny_model

        model = str(build_tiny_model())
    else:
        model = args.model
    tokenizer = AutoTokenizer.from_pretrained(model)
    # The process's first batch pays one-time costs (threads, allocator): not measured.
    asyncio.run(one_side(True, model, argparse.Namespace(**{**vars(args), "trajectories": 8}), tokenizer))
    runs = alternate(args.rounds, lambda told: asyncio.run(one_side(told, model, args, tokenizer)),
                     ("second_turn_misses", "wall_s"))
    keys = ("second_turn_hits", "second_turn_misses", "evictions", "forgotten", "entries_left",
            "prefill_tokens_per_trajectory", "wall_s")
    text = sides_table(runs, keys, f"{args.trajectories} two-turn trajectories, {args.concurrency} at a time, over "
                                   f"HTTP; prefix cache bound {runs[True][0]['cache_tokens_bound']} tokens; medians of "
                                   f"{args.rounds}")
    write_result(args.out, {
        "description": __doc__, "model": model, "settings": vars(args), "runs": {"told": runs[True], "not_told": runs[False]},
        "wall_ratio_told_over_not": median(runs[True], "wall_s") / median(runs[False], "wall_s"), "table_markdown": text,
        "versions": versions("torch", "transformers"),
    })


if __name__ == "__main__":
    main()
