"""Datasets as parquet rows: raw chat ``prompt``, ``agent_name``, ``data_source``,
``reward_model.ground_truth`` and ``extra_info.tools_kwargs`` (verl's layout)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

GSM8K_SYSTEM = (
    "Solve the math problem step by step. Use the calculator tool for arithmetic. "
    "End with the final answer as #### N."
)
"""System turn of converted GSM8K prompts."""


def parse_gsm8k_answer(answer: str) -> str:
    """The number after ``####`` in a GSM8K answer, commas removed.

    Raises:
        ValueError: when there is no ``#### N`` or N is not a number.
    """
    if "####" not in answer:
        raise ValueError("answer has no '#### N' final line")
    value = answer.rsplit("####", 1)[1].strip().replace(",", "")
    try:
        float(value)
    except ValueError:
        raise ValueError(f"final answer {value!r} is not a number") from None
    return value


def gsm8k_row(question: str, answer: str, split: str, index: int) -> dict[str, Any]:
    """One GSM8K example as a tool-agent dataset row."""
    truth = parse_gsm8k_answer(answer)
    return {
        "data_source": "openai/gsm8k",
        "agent_name": "tool_agent",
        "prompt": [{"role": "system", "content": GSM8K_SYSTEM}, {"role": "user", "content": question}],
        "reward_model": {"style": "rule", "ground_truth": truth},
        "extra_info": {
            "split": split,
            "index": index,
            "answer": answer,
            "question": question,
            "tools_kwargs": {"calculator": {"create_kwargs": {"ground_truth": truth}}},
        },
    }


def read_gsm8k_jsonl(path: str | Path, split: str) -> tuple[list[dict[str, Any]], list[tuple[int, str]]]:
    """Rows of a GSM8K jsonl file and the malformed lines.

    Returns:
        ``(rows, malformed)`` where ``malformed`` lists ``(line_number, reason)`` (1-based).
    """
    rows: list[dict[str, Any]] = []
    bad: list[tuple[int, str]] = []
    with Path(path).open(encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                bad.append((lineno, f"not JSON: {exc.msg}"))
                continue
            if not isinstance(obj, dict) or not isinstance(obj.get("question"), str) or not isinstance(obj.get("answer"), str):
                bad.append((lineno, "needs string fields 'question' and 'answer'"))
                continue
            try:
                rows.append(gsm8k_row(obj["question"], obj["answer"], split, len(rows)))
            except ValueError as exc:
                bad.append((lineno, str(exc)))
    return rows, bad


def write_parquet_rows(rows: list[dict[str, Any]], path: str | Path) -> Path:
    """Write rows to a parquet file."""
    import pandas as pd

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    pd.DataFrame(rows).to_parquet(path, index=False)
    return path


def read_parquet_rows(path: str | Path) -> list[dict[str, Any]]:
    """Rows of a parquet dataset as plain Python dicts and lists.

    Raises:
        FileNotFoundError: naming the path.
        ValueError: when required columns are missing.
    """
    import pyarrow.parquet as pq

    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"dataset {path} does not exist; create it with `agentloop data gsm8k --out DIR ...`")
    rows = pq.read_table(path).to_pylist()
    required = {"prompt", "reward_model"}
    if rows and not required <= set(rows[0]):
        raise ValueError(f"{path} lacks columns {sorted(required - set(rows[0]))}; expected verl-style rows")
    return rows


def convert_gsm8k(source: str | Path, out: str | Path) -> dict[str, tuple[int, list[tuple[int, str]]]]:
    """Convert ``source/{train,test}.jsonl`` to ``out/{train,test}.parquet``.

    Returns:
        Per split: rows written and the malformed ``(line, reason)`` list.

    Raises:
        FileNotFoundError: when a split file is missing.
    """
    source, out = Path(source), Path(out)
    counts = {}
    for split in ("train", "test"):
        src = source / f"{split}.jsonl"
        if not src.exists():
            raise FileNotFoundError(f"{src} not found; --from-jsonl must hold train.jsonl and test.jsonl")
        rows, bad = read_gsm8k_jsonl(src, split)
        write_parquet_rows(rows, out / f"{split}.parquet")
        counts[split] = (len(rows), bad)
    return counts
