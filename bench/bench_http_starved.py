"""Resets under a starved client: a burst of concurrent requests to the engine server while
other threads hold the GIL, as a busy trainer process does to its own HTTP client.

One process holds the client (httpx, 100 pooled connections), a real ``ServerThread`` over a
``ScriptedServer`` and ``--hogs`` pure-Python threads that spin. Each round sends
``--requests`` requests at once, the malformed mix of the fault suite's burst test plus
correct ones; every request must be answered (200 or a 4xx naming the problem). A *reset* is a
request whose connection the server closed under it (``httpx.ReadError``,
``RemoteProtocolError``): what the server's silence timers did to a request already on its way
before the fix in this release. Pool timeouts are the client's own queue (its 100 connections
busy past ``--pool-timeout-s``), counted apart.

Rows: the server limits as they were before (a new connection closed 10 s after connecting
unless it sent something, idle keep-alive 5 s like httpx's pool expiry) against the defaults.
The pre-release code also timed every head from connect; on that code the same burst
(3 hogs, 2 rounds of 300) gave ~145 resets.

Run: ``python bench/bench_http_starved.py [--hogs 3 --rounds 2]`` (minutes: the hogs slow
everything down; writes ``bench/results/http_starved.json``).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import load_average, table, versions, write_result  # noqa: E402

KEY = "sk-bench-starved"
GOOD = {"request_id": "ok", "prompt_ids": [1, 2, 3], "sampling_params": {"max_tokens": 4}}
BAD = [
    {"content": b"{not json"},
    {"content": b"\xff\xfe\x00garbage"},
    {"json": {"request_id": "", "prompt_ids": [1]}},
    {"json": {"request_id": "x", "prompt_ids": "abc"}},
    {"json": {"request_id": "x", "prompt_ids": [1], "sampling_params": {"max_tokens": -5}}},
    {"json": {"request_id": "x", "prompt_ids": [1], "extra": 1}},
    {"json": [1, 2, 3]},
    {"content": b"[" * 20000},
    {"json": {"request_id": "x", "prompt_ids": [1] * 40000}},  # over max_request_bytes: 413
    {"json": GOOD},
]


def hog(stop: threading.Event) -> None:
    while not stop.is_set():
        for _ in range(10_000):
            pass


async def burst(url: str, n: int, pool_timeout_s: float) -> collections.Counter:
    import httpx

    outcomes: collections.Counter = collections.Counter()
    timeout = httpx.Timeout(300.0, pool=pool_timeout_s)
    async with httpx.AsyncClient(base_url=url, timeout=timeout, limits=httpx.Limits(max_connections=100)) as client:

        async def send(i: int) -> None:
            kw = BAD[i % len(BAD)]
            headers = {"Authorization": f"Bearer {KEY}"} if i % 7 else {}
            if "content" in kw:
                headers["content-type"] = "application/json"
            try:
                r = await client.post("/generate", headers=headers, **kw)
            except (httpx.ReadError, httpx.RemoteProtocolError, httpx.WriteError):
                outcomes["reset"] += 1
            except httpx.PoolTimeout:
                outcomes["pool timeout"] += 1
            except httpx.HTTPError as exc:
                outcomes[type(exc).__name__] += 1
            else:
                outcomes["answered" if r.status_code in (200, 400, 401, 413, 422) else f"HTTP {r.status_code}"] += 1

        await asyncio.gather(*(send(i) for i in range(n)))
    return outcomes


def run(name: str, limits_kw: dict, args: argparse.Namespace) -> dict:
    from agentloop_core.testing import ScriptedServer
    from agentloop_engines.serving.common import ServerLimits
    from agentloop_engines.serving.server import ServerThread

    limits = ServerLimits(**limits_kw)
    stop = threading.Event()
    hogs = [threading.Thread(target=hog, args=(stop,), daemon=True) for _ in range(args.hogs)]
    total: collections.Counter = collections.Counter()
    started = time.perf_counter()
    with ServerThread(ScriptedServer(), api_key=KEY, max_request_bytes=64 * 1024, limits=limits) as srv:
        for t in hogs:
            t.start()
        try:
            for _ in range(args.rounds):
                total += asyncio.run(burst(srv.url, args.requests, args.pool_timeout_s))
        finally:
            stop.set()
            for t in hogs:
                t.join()
    return {"limits": name, **limits_kw, "outcomes": dict(total),
            "wall_s": round(time.perf_counter() - started, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hogs", type=int, default=3, help="threads spinning in Python beside client and server")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--requests", type=int, default=300, help="concurrent requests per round")
    parser.add_argument("--pool-timeout-s", type=float, default=120.0)
    args = parser.parse_args()
    load_start = load_average()
    configs = [("as before (first byte 10 s, keep-alive 5 s)", {"first_byte_timeout_s": 10.0, "keep_alive_timeout_s": 5}),
               ("defaults (first byte 60 s, keep-alive 60 s)", {})]
    results = [run(name, kw, args) for name, kw in configs]
    sent = args.rounds * args.requests
    rows = [(r["limits"], sent, r["outcomes"].get("answered", 0), r["outcomes"].get("reset", 0),
             r["outcomes"].get("pool timeout", 0),
             sum(v for k, v in r["outcomes"].items() if k not in ("answered", "reset", "pool timeout")), r["wall_s"])
            for r in results]
    text = table(["server limits", "requests", "answered", "resets", "pool timeouts", "other", "wall s"], rows,
                 title=f"{args.rounds} bursts of {args.requests} concurrent requests, {args.hogs} threads holding the GIL "
                       f"(load at start {load_start})")
    write_result("http_starved", {"hogs": args.hogs, "rounds": args.rounds, "requests": args.requests,
                                  "load_average_at_start": load_start, "results": results, "table": text,
                                  "versions": versions("httpx", "uvicorn", "h11")})


if __name__ == "__main__":
    main()
