"""Benchmark 4: per-turn tokenization cost as the history grows, delta vs full re-render.

Each turn appends one assistant message (a calculator call, as generated ids) and one tool
result. Three ways to get the ids for the tool result plus the next generation prompt:

* ``ours (delta)``: :meth:`Trajectory.append_generated` + :meth:`Trajectory.append_messages`,
  what ``tool_agent`` does: it renders the template for history and history + new message,
  and encodes only the difference.
* ``re-render``: apply the chat template to the whole history and encode all of it, every turn
  (what a loop that re-tokenizes the conversation does; it also re-encodes generated text).
* ``base-conversation delta``: :meth:`ChatRenderer.delta` against the fixed base conversation
  (the fallback path), which renders a constant-size text whatever the history length. Shown
  to measure what a constant-cost default would give; it is not what the loop runs today.

Run: ``python bench/bench_tokenization.py`` (writes ``bench/results/tokenization.json``).
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import load_average, table, versions, write_result  # noqa: E402

TURNS = 64
REPEATS = 5
CHECKPOINTS = (1, 2, 4, 8, 16, 32, 64)


def main() -> None:
    from agentloop_core.protocol import TokenOutput
    from agentloop_core.testing.tiny_tokenizer import load_tiny_tokenizer
    from agentloop_core.tokenization import ChatRenderer, Trajectory
    from agentloop_core.tokenization.renderer import BASE_CONVERSATION
    from agentloop_tools import calculator

    load_start = load_average()
    tok = load_tiny_tokenizer()
    schema = [calculator.tool_schema.model_dump(exclude_none=True)]
    renderer = ChatRenderer(tok, tools=schema)
    prompt = [{"role": "system", "content": "You are a careful assistant. Use the calculator."},
              {"role": "user", "content": "What is (17 + 25) * 3 - 4? Show your work."}]
    eos = tok.convert_tokens_to_ids("<|im_end|>")

    def call_ids(k: int) -> list[int]:
        text = ("Let me compute this step.\n<tool_call>\n"
                + json.dumps({"name": "calculator", "arguments": {"expression": f"({k} + 25) * 3 - 4"}})
                + "\n</tool_call>")
        return tok.encode(text, add_special_tokens=False) + [eos]

    ours: dict[int, list[float]] = {k: [] for k in range(1, TURNS + 1)}
    full: dict[int, list[float]] = {k: [] for k in range(1, TURNS + 1)}
    base: dict[int, list[float]] = {k: [] for k in range(1, TURNS + 1)}
    context_len: dict[int, int] = {}
    for _ in range(REPEATS):
        traj = Trajectory(renderer, prompt)
        for k in range(1, TURNS + 1):
            gen = TokenOutput(token_ids=call_ids(k), log_probs=None)
            tool_msg = {"role": "tool", "content": str((k + 25) * 3 - 4)}
            t0 = time.perf_counter()
            traj.append_generated(gen)
            traj.append_messages([tool_msg])
            ours[k].append(time.perf_counter() - t0)
            # The same conversation, re-rendered and re-encoded from scratch.
            t0 = time.perf_counter()
            ids = renderer.encode(renderer.render_text(traj.messages, add_generation_prompt=True))
            full[k].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            renderer.delta([*BASE_CONVERSATION, traj.messages[-2]], [tool_msg])
            base[k].append(time.perf_counter() - t0)
            context_len[k] = len(ids)

    rows = []
    per_turn = []
    for k in CHECKPOINTS:
        o, f, b = (statistics.median(x[k]) * 1e3 for x in (ours, full, base))
        rows.append((k, context_len[k], round(o, 3), round(f, 3), round(b, 3), round(f / o, 2)))
        per_turn.append({"turn": k, "context_tokens": context_len[k], "ours_delta_ms": o,
                         "rerender_ms": f, "base_conversation_delta_ms": b})
    text = table(["turn", "context tokens", "ours (delta) ms", "re-render ms", "base-conv delta ms",
                  "re-render / ours"], rows,
                 title="Per-turn tokenization cost (median of 5), tiny ChatML tokenizer")
    growth = {name: statistics.median(d[TURNS]) / statistics.median(d[1]) for name, d in
              (("ours_delta", ours), ("rerender", full), ("base_conversation_delta", base))}
    print("cost at turn 64 / cost at turn 1:", {k: round(v, 2) for k, v in growth.items()})
    write_result("tokenization", {
        "description": __doc__.split("Run:")[0].strip(),
        "load_average_at_start": load_start,
        "versions": versions("transformers", "tokenizers"),
        "turns": TURNS, "repeats": REPEATS,
        "per_turn": per_turn,
        "growth_turn64_over_turn1": growth,
        "goal": "ours flat as history grows",
        "goal_met": growth["ours_delta"] < 1.5,
        "table_markdown": text,
    })


if __name__ == "__main__":
    main()
