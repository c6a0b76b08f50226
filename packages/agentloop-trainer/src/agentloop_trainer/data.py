"""Datasets as parquet rows: raw chat ``prompt``, ``agent_name``, ``data_source``,
``reward_model.ground_truth`` and ``extra_info.tools_kwargs`` (verl's layout)."""

from __future__ import annotations

import json
import random
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

GSM8K_SYSTEM = (
    "Solve the math problem step by step. Use the calculator tool for arithmetic and check_answer to "
    "check your answer. End with the final answer as #### N."
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


def write_parquet_rows(rows: list[dict[str, Any]], path: str | Path) -> Path:
    """Write rows to a parquet file."""
    import pandas as pd

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    pd.DataFrame(rows).to_parquet(path, index=False)
    return path


def normalize_content(content: Any, where: str) -> str:
    """A message's content as text: a string, or a list of ``{"type": "text", "text": ...}``
    parts (OpenAI's list form) joined in order.

    Raises:
        ValueError: a part that is not text (images need a multimodal loop), naming ``where``.
    """
    if isinstance(content, str):
        return content
    if content is None:
        return ""
    if isinstance(content, (list, tuple)) or (hasattr(content, "__len__") and not isinstance(content, Mapping)):
        texts = []
        for k, part in enumerate(content):
            if isinstance(part, str):
                texts.append(part)
                continue
            kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
            if kind != "text" or not isinstance(part.get("text"), str):
                raise ValueError(f"{where} content part {k} is {kind!r}; only text parts "
                                 "({'type': 'text', 'text': ...}) are supported")
            texts.append(part["text"])
        return "".join(texts)
    raise ValueError(f"{where} content must be a string or a list of text parts, got {type(content).__name__}")


def normalize_messages(messages: Sequence[Mapping[str, Any]], where: str = "prompt") -> list[dict[str, Any]]:
    """Chat messages with text content, keys whose value is None dropped (parquet fills absent
    struct fields with None, which chat templates would render)."""
    out = []
    for k, m in enumerate(messages):
        msg = {key: v for key, v in dict(m).items() if v is not None}
        msg["content"] = normalize_content(m.get("content"), f"{where} message {k}")
        out.append(msg)
    return out


def check_row(row: Any, need_ground_truth: bool = True) -> str | None:
    """Why ``row`` is not a usable dataset row, or None when it is. Message content may be a
    string or a list of text parts; ``reward_model.ground_truth`` is needed unless the reward
    comes from the loop alone."""
    if not isinstance(row, dict):
        return "is not a mapping"
    prompt = row.get("prompt")
    if not isinstance(prompt, list) or not prompt:
        return "'prompt' must be a non-empty list of chat messages"
    for k, m in enumerate(prompt):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or m.get("content") is None:
            return f"prompt message {k} needs a string 'role' and 'content' (a string or a list of text parts)"
        try:
            normalize_content(m.get("content"), f"prompt message {k}")
        except ValueError as exc:
            return str(exc)
    rm = row.get("reward_model")
    if rm is not None and not isinstance(rm, dict):
        return "'reward_model' must be a mapping with 'ground_truth'"
    if need_ground_truth and (not isinstance(rm, dict) or rm.get("ground_truth") in (None, "")):
        return ("'reward_model.ground_truth' is missing (needed by the reward function; with rewards from "
                "the loop's tools alone set reward.source=loop)")
    extra = row.get("extra_info")
    if extra is not None and not isinstance(extra, dict):
        return "'extra_info' must be a mapping"
    if isinstance(extra, dict) and not isinstance(extra.get("tools_kwargs") or {}, dict):
        return "'extra_info.tools_kwargs' must be a mapping of tool name -> kwargs"
    return None


def read_parquet_files(paths: Any, key: str, need_ground_truth: bool = True) -> list[dict[str, Any]]:
    """Rows of one parquet file or a list of them (verl's ``data.train_files`` forms), in order.

    Raises:
        FileNotFoundError / ValueError: as :func:`read_parquet_rows`, naming the file.
    """
    if isinstance(paths, (str, Path)):
        paths = [paths]
    paths = list(paths)
    if not paths:
        raise ValueError(f"{key} is an empty list; give one parquet file or a list of them")
    rows: list[dict[str, Any]] = []
    for path in paths:
        rows.extend(read_parquet_rows(path, need_ground_truth=need_ground_truth))
    return rows


def read_parquet_rows(path: str | Path, need_ground_truth: bool = True) -> list[dict[str, Any]]:
    """Rows of a parquet dataset as plain Python dicts and lists, every row checked.

    Raises:
        FileNotFoundError: naming the path.
        ValueError: when required columns are missing or rows are malformed (row numbers
            and reasons named, up to 20).
    """
    import pyarrow.parquet as pq

    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"dataset {path} does not exist; create it with `agentloop data gsm8k --out DIR ...`")
    rows = pq.read_table(path).to_pylist()
    if not rows:
        raise ValueError(f"{path} has no rows")
    required = {"prompt", "reward_model"} if need_ground_truth else {"prompt"}
    if not required <= set(rows[0]):
        raise ValueError(f"{path} lacks columns {sorted(required - set(rows[0]))}; expected verl-style rows "
                         "(prompt, data_source, reward_model.ground_truth, extra_info)")
    bad = [(i, why) for i, row in enumerate(rows) if (why := check_row(row, need_ground_truth)) is not None]
    if bad:
        listed = "; ".join(f"row {i}: {why}" for i, why in bad[:20])
        more = f" (and {len(bad) - 20} more)" if len(bad) > 20 else ""
        raise ValueError(f"{path}: {len(bad)} of {len(rows)} rows are malformed: {listed}{more}")
    for i, row in enumerate(rows):
        # Text parts joined, absent struct fields (None) dropped: what the chat template renders.
        row["prompt"] = normalize_messages(row["prompt"], f"{path} row {i} prompt")
    return rows


def prompt_lengths(rows: Sequence[dict[str, Any]], tokenizer: Any, tools: list[dict[str, Any]] | None) -> list[int]:
    """Tokens of each row's prompt as the rollout renders it: the chat template with the
    rollout's tool schemas and the generation prompt."""
    lengths = []
    for row in rows:
        ids = tokenizer.apply_chat_template(list(row["prompt"]), tools=tools, tokenize=True,
                                            add_generation_prompt=True)
        if isinstance(ids, dict) or hasattr(ids, "keys"):  # BatchEncoding in transformers 5.x
            ids = ids["input_ids"]
        lengths.append(len(ids))
    return lengths


def limit_prompt_length(rows: Sequence[dict[str, Any]], tokenizer: Any, tools: list[dict[str, Any]] | None,
                        max_prompt_length: int, filter_overlong: bool, name: str = "dataset"
                        ) -> tuple[list[dict[str, Any]], int]:
    """Drop (``filter_overlong``) or reject prompts longer than ``max_prompt_length`` tokens.

    Returns:
        ``(kept rows, number dropped)``.

    Raises:
        ValueError: ``filter_overlong`` is false and a prompt is too long (row and length named).
    """
    lengths = prompt_lengths(rows, tokenizer, tools)
    over = [(i, n) for i, n in enumerate(lengths) if n > max_prompt_length]
    if over and not filter_overlong:
        listed = ", ".join(f"row {i} ({n} tokens)" for i, n in over[:10])
        raise ValueError(
            f"{name}: {len(over)} prompts exceed data.max_prompt_length={max_prompt_length} with the tool "
            f"schemas rendered: {listed}; raise data.max_prompt_length or set data.filter_overlong_prompts=true"
        )
    drop = {i for i, _ in over}
    return [r for i, r in enumerate(rows) if i not in drop], len(drop)


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


class DataIterator:
    """Epoch-shuffled batches of training rows with a resumable position."""

    def __init__(self, records: Sequence[dict], batch_size: int, seed: int, shuffle: bool = True) -> None:
        if batch_size > len(records):
            raise ValueError(f"data.train_batch_size={batch_size} exceeds the {len(records)} training rows")
        self.records, self.batch_size, self.seed, self.shuffle = list(records), batch_size, seed, shuffle
        self.epoch, self.position = 0, 0
        self._order = self._permutation()

    def _permutation(self) -> list[int]:
        order = list(range(len(self.records)))
        if self.shuffle:
            random.Random(self.seed * 1_000_003 + self.epoch).shuffle(order)
        return order

    def next_indices(self) -> list[int]:
        """The next ``batch_size`` rows as indices into ``records`` (a new epoch starts when too
        few remain); the asynchronous trainer checkpoints rows by these indices."""
        if self.position + self.batch_size > len(self._order):
            self.epoch, self.position = self.epoch + 1, 0
            self._order = self._permutation()
        idx = self._order[self.position : self.position + self.batch_size]
        self.position += self.batch_size
        return list(idx)

    def next_batch(self) -> list[dict]:
        """The next ``batch_size`` rows (a new epoch starts when too few remain)."""
        return [self.records[i] for i in self.next_indices()]

    def state(self) -> dict[str, int]:
        """Position to save in a checkpoint."""
        return {"epoch": self.epoch, "position": self.position}

    def load_state(self, state: dict[str, int]) -> None:
        """Continue from a saved position."""
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self._order = self._permutation()
