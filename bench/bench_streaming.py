"""Time to first token of the gateway's streamed answers, against the whole-answer time.

The real ``openai`` client calls a :class:`~agentloop_engines.serving.gateway.GatewayThread` over
loopback, in front of HFServer (CPU, greedy, ``ignore_eos``, ``--tokens`` new tokens, one
request at a time, after a warm-up). For each model:

* whole answer: a non-streamed request's wall time (what a simulated stream, generated whole
  then cut into chunks, took to its first content chunk);
* streamed: time to the first content chunk, to the last chunk, and the number of content
  chunks (one per token or few: the tokens arrive as they are decoded);
* disconnect: a streamed request of 1,000 tokens whose client leaves after its first chunks;
  how many tokens were decoded in all (the rest were never computed).

Models: the built-in tiny Qwen2, and the real SmolLM2-135M-Instruct when ``agentloop model
fetch smollm2-135m-instruct`` has it (``--model-dir``, or ``--no-real`` to skip).

Run: ``python bench/bench_streaming.py``; writes ``bench/results/streaming.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import load_average, table, versions, write_result  # noqa: E402

MESSAGES = [{"role": "user", "content": "Ann has 3 apples and buys 4 more. How many apples does she have?"}]


def real_model_dir() -> str | None:
    try:
        out = subprocess.run([sys.executable, "-c", "from agentloop_trainer.cli import main; main()", "model", "fetch",
                              "smollm2-135m-instruct"], capture_output=True, text=True, timeout=600, check=True)
    except (subprocess.SubprocessError, OSError):
        return None
    lines = [line for line in out.stdout.splitlines() if line.strip()]
    return lines[-1].strip() if lines and Path(lines[-1].strip()).is_dir() else None


def measure(model_dir: str, tokens: int, repeats: int) -> dict:
    import httpx
    import openai

    from agentloop_engines.adapters.hf import HFServer
    from agentloop_engines.serving.gateway import Gateway, GatewayThread

    engine = HFServer(model_dir, max_model_len=2048)
    gateway = Gateway(engine, engine.tokenizer)
    params = {"max_tokens": tokens, "temperature": 0.0, "extra_body": {"ignore_eos": True}}
    whole_s, first_s, last_s, chunks = [], [], [], []
    with GatewayThread(gateway) as t:
        client = openai.OpenAI(base_url=t.base_url, api_key="none", max_retries=0, timeout=600)
        client.chat.completions.create(model="m", messages=MESSAGES, **{**params, "max_tokens": 4})  # warm-up
        for i in range(repeats * 2):  # alternate the order, so neither kind always runs on a warmer engine
            if (i + (i // 2)) % 2 == 0:
                start = time.perf_counter()
                client.chat.completions.create(model="m", messages=MESSAGES, **params)
                whole_s.append(time.perf_counter() - start)
                continue
            start = time.perf_counter()
            first, n = None, 0
            for chunk in client.chat.completions.create(model="m", messages=MESSAGES, stream=True, **params):
                if chunk.choices and chunk.choices[0].delta.content:
                    n += 1
                    first = first if first is not None else time.perf_counter() - start
            last_s.append(time.perf_counter() - start)
            first_s.append(first if first is not None else float("nan"))
            chunks.append(n)
        before = engine.stats["generated_tokens"]
        body = {"model": "m", "messages": MESSAGES, "max_tokens": 1000, "temperature": 0.0, "ignore_eos": True,
                "stream": True}
        with httpx.Client(timeout=600) as http, http.stream("POST", f"{t.base_url}/chat/completions", json=body) as r:
            lines = r.iter_lines()
            for _ in range(6):
                next(lines)
        deadline = time.monotonic() + 120
        while engine._by_id and time.monotonic() < deadline:
            time.sleep(0.05)
        after_disconnect = engine.stats["generated_tokens"] - before
    asyncio.run(engine.close())
    return {"tokens": tokens, "repeats": repeats, "whole_s": statistics.median(whole_s),
            "first_chunk_s": statistics.median(first_s), "last_chunk_s": statistics.median(last_s),
            "content_chunks": statistics.median(chunks), "disconnect_asked": 1000,
            "disconnect_decoded": after_disconnect}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--model-dir", default=None, help="the real checkpoint (default: agentloop model fetch)")
    parser.add_argument("--no-real", action="store_true", help="only the tiny model")
    args = parser.parse_args()
    from agentloop_engines.testing.tiny_model import build_tiny_model

    models = {"tiny-qwen2": str(build_tiny_model(initializer_range=0.3))}
    real = None if args.no_real else (args.model_dir or real_model_dir())
    if real:
        models["smollm2-135m-instruct"] = real
    results = {name: measure(path, args.tokens, args.repeats) for name, path in models.items()}
    rows = [[name, r["tokens"], f"{r['whole_s']:.3f}", f"{r['first_chunk_s']:.3f}", f"{r['last_chunk_s']:.3f}",
             r["content_chunks"], f"{r['disconnect_decoded']} / {r['disconnect_asked']}"]
            for name, r in results.items()]
    print(table(["model", "tokens", "whole answer s", "stream: first chunk s", "stream: last chunk s",
                 "content chunks", "tokens decoded, client gone after 6 events"], rows,
                title="gateway streaming, HFServer on CPU, openai client over loopback (medians)"))
    write_result("streaming", {"what": " ".join(__doc__.split("\n\n")[1:3]).replace("\n", " "), "results": results, "load_average": load_average(),
                               "versions": versions("torch", "transformers", "openai")})


if __name__ == "__main__":
    main()
