"""Print the Markdown tables of ``bench/results/*.json`` with their date and load average
(what the Performance section of the READMEs is pasted from).

Usage: ``python bench/summary.py``
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import RESULTS_DIR  # noqa: E402

ORDER = ("main_job", "overlap", "routing", "loop_overhead", "scale", "tokenization", "trainer", "memory", "engines", "async")
"""The run_all benches, first and in this order (a missing one is named); every other results
file follows, by name."""


def tables(record: dict) -> list[str]:
    out = []
    if "table_markdown" in record:
        out.append(record["table_markdown"])
    for value in record.values():
        if isinstance(value, dict):
            out += [v["table_markdown"] for v in value.values() if isinstance(v, dict) and "table_markdown" in v]
            if "table_markdown" in value:
                out.append(value["table_markdown"])
    return out


def main(results: Path = RESULTS_DIR) -> None:
    others = sorted(p.stem for p in results.glob("*.json") if p.stem not in ORDER)
    for name in (*ORDER, *others):
        path = results / f"{name}.json"
        if not path.exists():
            print(f"### {name}\n\n(no results yet: run `python bench/run_all.py --only {name}`)\n")
            continue
        record = json.loads(path.read_text())
        load = record.get("load_average_at_start"), record.get("load_average_at_end")
        print(f"### {name}\n\n{str(record.get('date', 'undated'))[:10]}, load average (1/5/15 min) at start "
              f"{load[0]}, at end {load[1]}\n")
        for text in tables(record):
            print(text + "\n")


if __name__ == "__main__":
    main()
