"""What the trajectory viewer accepts from a JSONL: every field it relies on is checked here, once,
before anything is rendered.

A trajectories file is shared (attached to an issue, sent by a colleague), so its values are
not trusted: a value of the wrong type (a string token id, a list as a segment index, a mask of
``"yes"``) is neither rendered as markup nor dropped: it is kept as a :class:`BadValue`, which the
page shows marked with a warning sign, and listed in the page's banner of problems. Strings of
every field are escaped by the renderer (:func:`~agentloop_trainer.view.trajectory_html.html_text`),
whatever their type here; images (thumbnails included) are checked by
:func:`~agentloop_trainer.view.images.check_images`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from agentloop_trainer.view.images import check_images
from agentloop_trainer.view.values import BadValue, bad_value, is_int, is_number

TRAJECTORY_DIR = "trajectories"
"""Where the trainer writes its per-step samples inside a run folder."""

MAX_TOKEN_ID = 2**32 - 1
"""Largest id taken for a token (tokenizers index their vocabulary with 32-bit ids)."""

_INT_FIELDS = ("trajectory_index", "segment_index", "rollout_n", "step")
_NUMBER_FIELDS = ("reward", "advantage")
_ID_LISTS = ("prompt_ids", "response_ids", "expected_ids", "actual_ids")
_TEXT_LISTS = ("prompt_tokens", "response_tokens", "expected_tokens", "actual_tokens")

class _Checker:
    def __init__(self, index: int) -> None:
        self.index = index
        self.problems: list[str] = []

    def note(self, field: str, bad: BadValue) -> BadValue:
        self.problems.append(f"record {self.index}, {field}: {bad.why}: {bad.raw}")
        return bad

    def ids(self, record: dict[str, Any], field: str, optional: bool) -> None:
        value = record.get(field)
        if value is None:
            if not optional:
                record[field] = []
            return
        if not isinstance(value, list):
            self.note(field, bad_value(value, "not a list of token ids; shown as empty"))
            record[field] = []
            return
        record[field] = [v if is_int(v) and 0 <= v <= MAX_TOKEN_ID
                         else self.note(f"{field}[{k}]", bad_value(v, "not an integer token id"))
                         for k, v in enumerate(value)]

    def texts(self, record: dict[str, Any], field: str) -> None:
        value = record.get(field)
        if value is None:
            return
        if not isinstance(value, list):
            self.note(field, bad_value(value, "not a list of token texts; ids shown instead"))
            record[field] = None
            return
        record[field] = [v if v is None or isinstance(v, str) else self.note(f"{field}[{k}]", bad_value(v, "not a text"))
                         for k, v in enumerate(value)]

    def mask(self, record: dict[str, Any]) -> None:
        n = len(record["response_ids"])
        value = record.get("response_mask")
        if value is None:
            record["response_mask"] = [0] * n
            return
        if not isinstance(value, list):
            self.note("response_mask", bad_value(value, "not a list of 0/1"))
            value = []
        mask = [int(v) if isinstance(v, bool) or (is_int(v) and v in (0, 1))
                else self.note(f"response_mask[{k}]", bad_value(v, "not 0 or 1")) for k, v in enumerate(value)]
        if len(mask) != n:
            self.problems.append(f"record {self.index}, response_mask: {len(mask)} entries for {n} response "
                                 "ids; the tokens without one are marked")
            mask = mask[:n] + [BadValue("(missing)", "no mask entry")] * (n - len(mask))
        record["response_mask"] = mask

    def log_probs(self, record: dict[str, Any]) -> None:
        value = record.get("rollout_log_probs")
        if value is None:
            return
        if not isinstance(value, list):
            self.note("rollout_log_probs", bad_value(value, "not a list of numbers"))
            record["rollout_log_probs"] = None
            return
        record["rollout_log_probs"] = [
            float(v) if is_number(v) else None if v is None
            else self.note(f"rollout_log_probs[{k}]", bad_value(v, "not a number")) for k, v in enumerate(value)]


def check_records(records: Sequence[Any]) -> tuple[list[dict[str, Any]], list[str]]:
    """Checked copies of ``records`` (the input is not changed) and the problems found, one line
    each naming the record, the field and the value."""
    out: list[dict[str, Any]] = []
    problems: list[str] = []
    for i, original in enumerate(records):
        check = _Checker(i)
        if not isinstance(original, Mapping):
            check.note("(record)", bad_value(original, "not a JSON object; shown as an empty record"))
            original = {}
        record = dict(original)
        for field in _INT_FIELDS:
            value = record.get(field)
            if value is not None and not is_int(value):
                record[field] = check.note(field, bad_value(value, "not an integer"))
        for field in _NUMBER_FIELDS:
            value = record.get(field)
            if value is not None and not is_number(value):
                record[field] = check.note(field, bad_value(value, "not a number"))
        for field in _ID_LISTS:
            check.ids(record, field, optional=field in ("expected_ids", "actual_ids"))
        for field in _TEXT_LISTS:
            check.texts(record, field)
        check.mask(record)
        check.log_probs(record)
        check_images(record, check.note)
        for field, kind in (("metrics", Mapping), ("messages", list)):
            value = record.get(field)
            if value is not None and not isinstance(value, kind):
                check.note(field, bad_value(value, f"not a JSON {'object' if kind is Mapping else 'list'}"))
                record[field] = {} if kind is Mapping else [value]
        out.append(record)
        problems += check.problems
    return out, problems


def load_records(path: str | Path) -> list[dict[str, Any]]:
    """Records of a trajectories JSONL, or of every ``trajectories/step_<N>.jsonl`` of a run
    folder (in step order; also a folder holding JSONL files directly).

    Raises:
        FileNotFoundError: no such path, or a folder without trajectory files.
    """
    path = Path(path)
    if path.is_dir():
        folder = path / TRAJECTORY_DIR if (path / TRAJECTORY_DIR).is_dir() else path
        files = sorted(folder.glob("*.jsonl"), key=lambda p: (_step_of(p), p.name))
        if not files:
            raise FileNotFoundError(
                f"{path} holds no trajectories: a run folder has {TRAJECTORY_DIR}/step_<N>.jsonl when "
                "trainer.log_trajectories_per_step was set; `agentloop rollout CHECKPOINT --out x.jsonl` "
                "writes a file this command reads")
    elif path.is_file():
        files = [path]
    else:
        raise FileNotFoundError(f"{path}: no such file or folder")
    records = []
    for file in files:
        for n, line in enumerate(file.read_text().splitlines(), 1):
            if line.strip():
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise ValueError(f"{file}:{n}: not a JSON record ({exc})") from exc
                except RecursionError:
                    raise ValueError(f"{file}:{n}: nested too deeply to be a trajectory record") from None
                if not isinstance(record, dict):
                    raise ValueError(f"{file}:{n}: a record must be a JSON object, got {type(record).__name__}; "
                                     "each line of a trajectories JSONL is one object")
                if "step" not in record and _step_of(file) >= 0:
                    record["step"] = _step_of(file)
                records.append(record)
    return records


def _step_of(path: Path) -> int:
    stem = path.stem
    return int(stem[5:]) if stem.startswith("step_") and stem[5:].isdigit() else -1
