"""SFT datasets in verl's multi-turn layout: read parquet or jsonl, check every row.

A row has ``messages`` (chat messages: ``system``/``user``/``assistant``/``tool``; assistant
messages may carry ``tool_calls`` in OpenAI form, ``{"id", "type": "function", "function":
{"name", "arguments"}}`` with arguments a JSON object or a JSON string of one) and optionally
``tools`` (a list of OpenAI function schemas, or a JSON string of that list). Every malformed
row is named by its number with what is wrong and how to fix it, before anything is trained.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agentloop_trainer.task.demonstrations import DEFAULT_ANSWER_FORMAT, calculator_rows

ROLES = ("system", "user", "assistant", "tool")
"""Message roles an SFT conversation may use."""
MAX_LISTED = 20
"""Malformed rows named in one error."""


class SFTDataError(ValueError):
    """An SFT dataset cannot be used; the message names the rows and the fixes."""


@dataclass(frozen=True)
class SFTExample:
    """One conversation to train on."""

    messages: list[dict[str, Any]]
    """Chat messages, normalized: text content, tool call arguments as objects, no None fields."""
    tools: list[dict[str, Any]] | None
    """Tool schemas rendered into the prompt; None: no tools."""
    source: str
    """``<file> row <n>``, for error messages."""


def _plain(value: Any) -> Any:
    """numpy arrays and scalars (pandas' parquet rows) as lists and Python scalars."""
    if hasattr(value, "tolist") and not isinstance(value, (str, bytes)):
        return _plain(value.tolist())
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _arguments(raw: Any, where: str) -> dict[str, Any]:
    if isinstance(raw, str):
        try:
            raw = json.loads(raw) if raw.strip() else {}
        except json.JSONDecodeError as exc:
            raise ValueError(f"{where} arguments are not parseable JSON ({exc.msg} at {exc.pos}); write them as a "
                             "JSON object or a JSON string of one") from None
    if not isinstance(raw, Mapping):
        raise ValueError(f"{where} arguments must be a JSON object, got {type(raw).__name__}")
    return dict(raw)


def _tool_call(call: Any, where: str) -> dict[str, Any]:
    if not isinstance(call, Mapping):
        raise ValueError(f"{where} is a {type(call).__name__}; write {{'type': 'function', 'function': "
                         "{'name': ..., 'arguments': ...}}")
    spec = call.get("function", call)
    if not isinstance(spec, Mapping) or not isinstance(spec.get("name"), str) or not spec.get("name"):
        raise ValueError(f"{where} has no function name; write {{'type': 'function', 'function': {{'name': ..., "
                         "'arguments': ...}}")
    out: dict[str, Any] = {"type": "function",
                           "function": {"name": spec["name"], "arguments": _arguments(spec.get("arguments"), where)}}
    if call.get("id") is not None:
        out["id"] = str(call["id"])
    return out


def _tools(raw: Any) -> list[dict[str, Any]] | None:
    if raw is None:
        return None
    if isinstance(raw, str):
        if not raw.strip():
            return None
        try:
            raw = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise ValueError(f"'tools' is a string but not JSON ({exc.msg}); give a list of function schemas or "
                             "a JSON string of one") from None
    if isinstance(raw, Mapping):
        raw = [raw]
    if not isinstance(raw, list) or not all(isinstance(t, Mapping) for t in raw):
        raise ValueError("'tools' must be a list of function schemas ({'type': 'function', 'function': {...}}) "
                         "or a JSON string of one")
    return [dict(t) for t in raw] or None


def _tool_names(tools: list[dict[str, Any]] | None) -> set[str]:
    names = set()
    for t in tools or []:
        spec = t.get("function", t)
        if isinstance(spec, Mapping) and isinstance(spec.get("name"), str):
            names.add(spec["name"])
    return names


def parse_row(row: Any, source: str = "row") -> SFTExample:
    """One dataset row as an :class:`SFTExample`.

    Raises:
        ValueError: what is wrong with the row and how to fix it.
    """
    from agentloop_trainer.data.rows import normalize_content

    row = _plain(row)
    if not isinstance(row, Mapping):
        raise ValueError(f"is a {type(row).__name__}, not a mapping with 'messages'")
    raw = row.get("messages")
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except json.JSONDecodeError:
            raise ValueError("'messages' is a string but not JSON; give a list of chat messages") from None
    if not isinstance(raw, list) or not raw:
        raise ValueError("'messages' must be a non-empty list of chat messages ({'role': ..., 'content': ...})")
    tools = _tools(row.get("tools"))
    known = _tool_names(tools)
    messages: list[dict[str, Any]] = []
    for k, m in enumerate(raw):
        where = f"message {k}"
        if not isinstance(m, Mapping):
            raise ValueError(f"{where} is a {type(m).__name__}, not a mapping with 'role' and 'content'")
        # Parquet fills a struct's absent fields with None; a template would render them.
        msg = {key: v for key, v in m.items() if v is not None}
        role = msg.get("role")
        if role not in ROLES:
            raise ValueError(f"{where} has unknown role {role!r}; use one of {', '.join(ROLES)}")
        msg["content"] = normalize_content(msg.get("content"), where)
        if "tool_calls" in msg:
            calls = msg["tool_calls"]
            if role != "assistant":
                raise ValueError(f"{where} is a {role} message with tool_calls; only assistant turns call tools")
            if not isinstance(calls, list):
                raise ValueError(f"{where} tool_calls must be a list of calls")
            msg["tool_calls"] = [_tool_call(c, f"{where} tool call {j}") for j, c in enumerate(calls)]
            if not msg["tool_calls"]:
                del msg["tool_calls"]
            for c in msg.get("tool_calls", []):
                name = c["function"]["name"]
                if tools is not None and name not in known:
                    raise ValueError(f"{where} calls {name!r}, which is not in the row's tools {sorted(known)}; add "
                                     "its schema to 'tools' or fix the name")
        if role == "tool" and (not messages or messages[-1]["role"] not in ("assistant", "tool")):
            raise ValueError(f"{where} is a tool result that does not follow an assistant turn (or another tool "
                             "result); put the assistant turn that made the call before it")
        if role == "assistant" and messages and messages[-1]["role"] == "assistant":
            raise ValueError(f"messages {k - 1} and {k} are both assistant turns; merge them (a rollout puts a "
                             "tool result or a user turn between two assistant turns)")
        messages.append(msg)
    roles = [m["role"] for m in messages]
    if "assistant" not in roles:
        raise ValueError("has no assistant turn, so nothing to train; add the assistant's reply")
    if roles[0] == "assistant":
        raise ValueError("starts with an assistant turn; put the system or user prompt it answers first")
    if roles[-1] != "assistant":
        raise ValueError(f"ends with a {roles[-1]} message, which is never trained; end it with the assistant's "
                         "reply or drop the trailing messages")
    return SFTExample(messages, tools, source)


def _read_rows(path: Path) -> list[Any]:
    if path.suffix in (".jsonl", ".json"):
        rows: list[Any] = []
        with path.open(encoding="utf-8") as fh:
            for lineno, line in enumerate(fh, start=1):
                if not line.strip():
                    continue
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as exc:
                    rows.append(ValueError(f"line {lineno} is not JSON ({exc.msg})"))
        return rows
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    raise SFTDataError(f"{path}: unknown SFT file type {path.suffix!r}; use .parquet or .jsonl")


def read_sft_files(paths: Any, key: str = "sft.train_files") -> list[SFTExample]:
    """Every row of one file or a list of them (parquet or jsonl), checked.

    Args:
        paths: A path or a list of paths.
        key: The config key they came from, for messages.

    Raises:
        FileNotFoundError: a file does not exist.
        SFTDataError: a file has no rows or malformed rows (up to :data:`MAX_LISTED` named,
            each with its fix).
    """
    if isinstance(paths, (str, Path)):
        paths = [paths]
    paths = [Path(p) for p in (paths or [])]
    if not paths:
        raise SFTDataError(f"{key} is empty; give a parquet or jsonl file (or a list of them)")
    examples: list[SFTExample] = []
    for path in paths:
        if not path.exists():
            raise FileNotFoundError(f"{key}: {path} does not exist (write calculator demonstrations with "
                                    "`agentloop data calculator-sft --out FILE.parquet`)")
        rows = _read_rows(path)
        if not rows:
            raise SFTDataError(f"{key}: {path} has no rows")
        bad: list[str] = []
        for i, row in enumerate(rows):
            try:
                if isinstance(row, Exception):
                    raise row
                examples.append(parse_row(row, f"{path} row {i}"))
            except ValueError as exc:
                bad.append(f"row {i}: {exc}")
        if bad:
            listed = "; ".join(bad[:MAX_LISTED])
            more = f" (and {len(bad) - MAX_LISTED} more)" if len(bad) > MAX_LISTED else ""
            raise SFTDataError(f"{key}: {path}: {len(bad)} of {len(rows)} rows are malformed: {listed}{more}")
    return examples


def write_sft_rows(rows: list[dict[str, Any]], path: str | Path) -> Path:
    """Write SFT rows to ``.parquet`` or ``.jsonl`` (by suffix). ``tools`` is stored as a JSON
    string and tool call arguments as JSON strings (OpenAI's form), so every row has one
    parquet schema whatever its tools' parameters."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    out = []
    for row in rows:
        row = dict(row)
        if row.get("tools") is not None and not isinstance(row["tools"], str):
            row["tools"] = json.dumps(row["tools"])
        row["messages"] = [_wire_message(m) for m in row["messages"]]
        out.append(row)
    if path.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(out), path)
    elif path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in out), encoding="utf-8")
    else:
        raise SFTDataError(f"{path}: write .parquet or .jsonl")
    return path


def _wire_message(message: Mapping[str, Any]) -> dict[str, Any]:
    m = dict(message)
    if m.get("tool_calls"):
        calls = []
        for c in m["tool_calls"]:
            spec = dict(c["function"])
            if not isinstance(spec.get("arguments"), str):
                spec["arguments"] = json.dumps(spec.get("arguments", {}))
            calls.append({**c, "function": spec})
        m["tool_calls"] = calls
    return m


def write_calculator_sft(out: str | Path, n: int, seed: int = 0, flip_prob: float = 0.0,
                         answer_format: str = DEFAULT_ANSWER_FORMAT) -> Path:
    """Write :func:`~agentloop_trainer.task.demonstrations.calculator_rows` to ``out`` (``.parquet`` or ``.jsonl``)."""
    return write_sft_rows(calculator_rows(n, seed, flip_prob, answer_format), out)

