"""GSM8K as training rows in verl's layout (``agentloop data gsm8k``): from GSM8K's own jsonl
files or from ``openai/gsm8k`` on the Hugging Face Hub."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from agentloop_trainer.data.rows import write_parquet_rows

GSM8K_SYSTEM = (
    "Solve the math problem step by step. Use the calculator tool for arithmetic and check_answer once "
    "to submit your final answer (only the first check counts). End with the final answer as #### N."
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
            "tools_kwargs": {"check_answer": {"create_kwargs": {"ground_truth": truth}}},
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


GSM8K_HUB_FILES = {"train": "main/train-00000-of-00001.parquet", "test": "main/test-00000-of-00001.parquet"}
"""Files of the ``openai/gsm8k`` dataset repository on the Hugging Face Hub."""


def _hub_gsm8k_rows(split: str) -> tuple[list[dict[str, Any]], list[tuple[int, str]]]:
    """GSM8K ``split`` from the Hugging Face Hub (cached by huggingface_hub)."""
    import pyarrow.parquet as pq

    try:
        from huggingface_hub import hf_hub_download

        local = hf_hub_download("openai/gsm8k", GSM8K_HUB_FILES[split], repo_type="dataset")
    except Exception as exc:  # noqa: BLE001 - offline, blocked, or no huggingface_hub: all need the same fix
        raise RuntimeError(
            f"cannot download openai/gsm8k ({split}) from the Hugging Face Hub: {type(exc).__name__}: "
            f"{str(exc).splitlines()[0] if str(exc) else ''}; offline, pass --from-jsonl DIR with GSM8K's "
            "train.jsonl and test.jsonl"
        ) from exc
    rows: list[dict[str, Any]] = []
    bad: list[tuple[int, str]] = []
    for i, obj in enumerate(pq.read_table(local).to_pylist(), start=1):
        try:
            rows.append(gsm8k_row(obj["question"], obj["answer"], split, len(rows)))
        except (KeyError, TypeError, ValueError) as exc:
            bad.append((i, str(exc)))
    return rows, bad


def convert_gsm8k(source: str | Path | None, out: str | Path) -> dict[str, tuple[int, list[tuple[int, str]]]]:
    """Convert GSM8K to ``out/{train,test}.parquet``: from ``source/{train,test}.jsonl`` (GSM8K's
    own format) or, when ``source`` is None, from ``openai/gsm8k`` on the Hugging Face Hub.

    Returns:
        Per split: rows written and the malformed ``(line, reason)`` list.

    Raises:
        FileNotFoundError: when a split file is missing.
        RuntimeError: ``source`` is None and the Hub cannot be reached (names the offline fix).
    """
    out = Path(out)
    counts = {}
    for split in ("train", "test"):
        if source is None:
            rows, bad = _hub_gsm8k_rows(split)
        else:
            src = Path(source) / f"{split}.jsonl"
            if not src.exists():
                raise FileNotFoundError(f"{src} not found; --from-jsonl must hold train.jsonl and test.jsonl")
            rows, bad = read_gsm8k_jsonl(src, split)
        write_parquet_rows(rows, out / f"{split}.parquet")
        counts[split] = (len(rows), bad)
    return counts
