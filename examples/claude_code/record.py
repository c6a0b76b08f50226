"""Record one Claude Code task on the tiny model: the bundled CLI of ``claude-agent-sdk`` talks
to a gateway session (``ANTHROPIC_BASE_URL``), nothing else, and the session holds the exact
token ids of every call it made.

    pip install claude-agent-sdk "agentloop-engines[hf,server]"
    python examples/claude_code/record.py --out /tmp/claude_code_calls.json

Claude Code's first call renders to about 43,000 tokens (its system prompt and tool schemas),
so the tiny model is built with a 64k context. The tiny model is random: what it answers is
noise, and Claude Code ends the task on it; the point is that every call arrives, is answered in
the Messages API's own stream, and is recorded token-exactly (checked below against the
engine's own record of what it generated).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import threading
from pathlib import Path

from agentloop_core.protocol import TokenOutput
from agentloop_engines.adapters.hf import HFServer
from agentloop_engines.serving.gateway import Gateway, GatewayThread
from agentloop_engines.testing.tiny_model import build_tiny_model

PROMPT = "What is 6*7? Answer with the number only."
OFFLINE_ENV = {"CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "DISABLE_TELEMETRY": "1", "DISABLE_AUTOUPDATER": "1",
               "DISABLE_ERROR_REPORTING": "1", "ANTHROPIC_API_KEY": "unused"}
"""What keeps the CLI off the network: no telemetry, no update check, no error reports."""


class Recorded(HFServer):
    """The engine, keeping what it generated for each call (to check the session against)."""

    generated: list[TokenOutput]

    async def generate(self, request_id, prompt_ids, sampling_params=None, **kwargs):  # type: ignore[override]
        out = await super().generate(request_id, prompt_ids, sampling_params, **kwargs)
        self.generated.append(out)
        return out

    async def generate_stream(self, request_id, prompt_ids, sampling_params=None, **kwargs):  # type: ignore[override]
        async for delta in super().generate_stream(request_id, prompt_ids, sampling_params, **kwargs):
            if delta.output is not None:
                self.generated.append(delta.output)
            yield delta


def main(argv: list[str] | None = None) -> int:
    from claude_agent_sdk import ClaudeAgentOptions, query

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=None, help="write the recorded calls here as JSON")
    ap.add_argument("--response-length", type=int, default=48, help="the session's response budget (tokens)")
    ap.add_argument("--max-turns", type=int, default=2)
    args = ap.parse_args(argv)

    model = build_tiny_model(max_position_embeddings=65536)
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    engine = Recorded(str(model), max_model_len=65536)
    engine.generated = []
    gateway = Gateway(engine, engine.tokenizer, tool_parser="hermes", server_loop=loop)
    gateway.open_session("claude-code", response_length=args.response_length)
    with GatewayThread(gateway) as thread, tempfile.TemporaryDirectory() as home:
        base = thread.session_url("claude-code").removesuffix("/v1")
        env = {**OFFLINE_ENV, "ANTHROPIC_BASE_URL": base, "HOME": home, "ANTHROPIC_MODEL": "policy"}
        options = ClaudeAgentOptions(env=env, cwd=home, max_turns=args.max_turns, model="policy")

        async def run() -> list[str]:
            return [type(m).__name__ async for m in query(prompt=PROMPT, options=options)]

        try:
            seen = asyncio.run(asyncio.wait_for(run(), 600))
        except Exception as exc:  # noqa: BLE001 - reported; the calls recorded so far are checked
            seen = [f"{type(exc).__name__}: {str(exc)[:300]}"]
        calls = gateway.close_session("claude-code")
    loop.call_soon_threadsafe(loop.stop)
    print(f"Claude Code messages: {seen}")
    for i, call in enumerate(calls):
        print(f"call {i}: {call.endpoint}, prompt {len(call.prompt_ids)} tokens, generated {len(call.token_ids)}, "
              f"finish {call.finish_reason}, extends previous: {call.extra.get('extends_previous')}")
    exact = [c.token_ids for c in calls] == [list(o.token_ids) for o in engine.generated[: len(calls)]]
    print(f"recorded ids equal the engine's: {exact}")
    if args.out is not None:
        args.out.write_text(json.dumps([c.as_dict() for c in calls]))
    return 0 if calls and exact and all(c.endpoint == "messages" for c in calls) else 1


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "2")
    sys.exit(main())
