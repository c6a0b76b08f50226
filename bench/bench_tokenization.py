"""Benchmark 4: per-turn tokenization cost as the history grows, delta vs full re-render.

Each turn appends one assistant message (a calculator call, as generated ids) and one tool
result. Three ways to get the ids for the tool result plus the next generation prompt:

* ``ours (delta)``: :meth:`Trajectory.append_generated` + :meth:`Trajectory.append_messages`,
  what ``tool_agent`` does, with the default ``delta_strategy="auto"``: the first deltas of a
  shape are rendered after the whole history and after a fixed user message + the last
  assistant turn (generated turns as opaque markers, cut after the last one); once they agree,
  only the latter (constant size); only the cut-off text is encoded.
* ``history delta``: the same with ``delta_strategy="history"`` (renders the template over the
  whole history + new messages every turn).
* ``re-render``: apply the chat template to the whole history and encode all of it, every turn
  (what a loop that re-tokenizes the conversation does; it also re-encodes generated text).

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
    from agentloop_tools import calculator

    load_start = load_average()
    tok = load_tiny_tokenizer()
    schema = [calculator.tool_schema.model_dump(exclude_none=True)]
    renderer = ChatRenderer(tok, tools=schema)
    history_renderer = ChatRenderer(tok, tools=schema, delta_strategy="history")
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
    hist: dict[int, list[float]] = {k: [] for k in range(1, TURNS + 1)}
    context_len: dict[int, int] = {}
    for _ in range(REPEATS):
        traj = Trajectory(renderer, prompt)
        htraj = Trajectory(history_renderer, prompt)
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
            htraj.append_generated(gen)
            htraj.append_messages([tool_msg])
            hist[k].append(time.perf_counter() - t0)
            assert htraj.context_ids == traj.context_ids, "the strategies must build the same ids"
            context_len[k] = len(ids)

    rows = []
    per_turn = []
    for k in CHECKPOINTS:
        o, f, h = (statistics.median(x[k]) * 1e3 for x in (ours, full, hist))
        rows.append((k, context_len[k], round(o, 3), round(h, 3), round(f, 3), round(f / o, 2)))
        per_turn.append({"turn": k, "context_tokens": context_len[k], "ours_delta_ms": o,
                         "history_delta_ms": h, "rerender_ms": f})
    text = table(["turn", "context tokens", "ours (auto delta) ms", "history delta ms", "re-render ms",
                  "re-render / ours"], rows,
                 title="Per-turn tokenization cost (median of 5), tiny ChatML tokenizer")
    growth = {name: statistics.median(d[TURNS]) / statistics.median(d[1]) for name, d in
              (("ours_delta", ours), ("history_delta", hist), ("rerender", full))}
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
