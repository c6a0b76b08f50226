"""A hostile trajectories JSONL for ``agentloop view``: markup-breaking strings in every field
(token ids, texts, messages, tool names, metrics keys and values, unknown keys) and values of
the wrong type in every field.

The page is parsed with :mod:`html.parser` and compared with the page of a twin file, the same
records with every string replaced by a harmless one: the hostile page must have exactly the
twin's elements and attribute names, only the template's script and stylesheet, only the
template's classes and ids, and no event handler. Values of the wrong type are shown marked and
listed, never dropped.
"""

from __future__ import annotations

import json
import re
from html.parser import HTMLParser
from typing import Any

import pytest

from agentloop_trainer.view.viewer import load_records, render_html, write_view
from agentloop_trainer.view.viewer_assets import PAGE_CSS, PAGE_JS
from agentloop_trainer.view.viewer_input import check_records

HOSTILE = [
    '1" onmouseover="alert(1)',
    "1' onmouseover='alert(1)' x='",
    "</script><script>alert(1)</script>",
    "<img src=x onerror=alert(1)>",
    "<svg/onload=alert(1)>",
    "<!-- ",
    " -->",
    "]]>",
    "</style><style>*{display:none}</style>",
    "</title><script>alert(2)</script>",
    "</textarea></pre></details></section></div><script>alert(3)</script>",
    '" hidden data-index="0" class="traj-row',
    "\u2028\u2029",
    "\ud800 lone surrogate",
    "nul \x00 byte",
    "&lt;script&gt; already escaped",
    "javascript:alert(1)",
    "<|im_start|>",
]


def _hostile_record(i: int, h: str) -> dict[str, Any]:
    """A record with ``h`` in every string field and as ids; integers only where the old viewer
    called int() (so the old code renders it and shows what it injects)."""
    return {
        "group_id": h, "rollout_n": 0, "ground_truth": h, "trajectory_index": i, "segment_index": 0,
        "data_source": h, "reward": 0.5, "failed": False, "step": 1, "advantage": 0.25,
        "prompt_ids": [1, h, 2], "response_ids": [h, 3, 4, 5], "response_mask": [1, 1, 0, 1],
        "rollout_log_probs": [-0.1, -0.2, None, -0.3],
        "prompt_tokens": [h, h, h], "response_tokens": [h, h, h, h],
        "messages": [{"role": h, "content": h, "name": h,
                      "tool_calls": [{"function": {"name": h, "arguments": h}}, {"name": h, "arguments": {h: h}}]},
                     {"role": "tool", "content": [{"type": "text", "text": h}]}, h],
        "metrics": {h: h, "error": h, f"{h}-2": 1.5}, "reported_metrics": [{h: h}],
        "expected_ids": [1, h, 2], "actual_ids": [1, 9, h], "expected_tokens": [h, h, h], "actual_tokens": [h, h, h],
        "extra_fields": {h: h}, h: h,
    }


WRONG_TYPES = [["a", {"b": 1}], {"k": [1, 2]}, True, 1.5, -1, 2**70, "7", None, float("nan")]
FIELDS = ["group_id", "rollout_n", "ground_truth", "trajectory_index", "segment_index", "data_source", "reward",
          "failed", "step", "advantage", "prompt_ids", "response_ids", "response_mask", "rollout_log_probs",
          "prompt_tokens", "response_tokens", "messages", "metrics", "expected_ids", "actual_ids"]


def _typed_records() -> list[dict[str, Any]]:
    """Per field, the base record with that field (and then one element of it) of each wrong type."""
    out = []
    for field in FIELDS:
        for value in WRONG_TYPES:
            record = _hostile_record(len(out), HOSTILE[len(out) % len(HOSTILE)])
            record[field] = value
            out.append(record)
            if isinstance(_hostile_record(0, "x")[field], list):
                record = _hostile_record(len(out), HOSTILE[len(out) % len(HOSTILE)])
                record[field] = [value, *record[field][1:]]
                out.append(record)
    return out


def _twin(value: Any, names: dict[str, str]) -> Any:
    """``value`` with every string replaced by a harmless one, distinct per string (keys too, but
    the format's own field names)."""
    if isinstance(value, str):
        return names.setdefault(value, f"s{len(names)}")
    if isinstance(value, list):
        return [_twin(v, names) for v in value]
    if isinstance(value, dict):
        return {k if re.fullmatch(r"[a-z_]+", k) else _twin(k, names): _twin(v, names) for k, v in value.items()}
    return value


class _Page(HTMLParser):
    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.elements: list[tuple[str, tuple[str, ...]]] = []
        self.attrs: list[tuple[str, str, str | None]] = []
        self.raw_text: dict[str, list[str]] = {"script": [], "style": [], "title": []}
        self.comments: list[str] = []
        self.declarations: list[str] = []
        self._open: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.elements.append((tag, tuple(sorted(name for name, _ in attrs))))
        self.attrs += [(tag, name, value) for name, value in attrs]
        self._open.append(tag)

    def handle_startendtag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.handle_starttag(tag, attrs)

    def handle_endtag(self, tag: str) -> None:
        if self._open and self._open[-1] == tag:
            self._open.pop()

    def handle_data(self, data: str) -> None:
        if self._open and self._open[-1] in self.raw_text:
            self.raw_text[self._open[-1]].append(data)

    def handle_comment(self, data: str) -> None:
        self.comments.append(data)

    def handle_decl(self, decl: str) -> None:
        self.declarations.append(decl)

    def unknown_decl(self, data: str) -> None:
        self.declarations.append(data)

    def handle_pi(self, data: str) -> None:
        self.declarations.append(data)


def _parse(page: str) -> _Page:
    parser = _Page()
    parser.feed(page)
    parser.close()
    return parser


ALLOWED_ATTRS = {"class", "id", "title", "style", "hidden", "lang", "charset", "type", "placeholder", "value",
                 "step", "colspan", "open", "data-id", "data-i", "data-lp", "data-index", "data-turn", "data-segment",
                 "data-first", "data-key", *(f"data-{k}" for k in ("step", "group", "sample", "reward", "failed",
                                                                  "length", "generated", "tools", "segments", "verdict"))}
TEMPLATE_CLASSES = {"muted", "legend", "tok", "gen", "ctx", "glue", "prompt", "bad", "good", "stream", "prompt-part",
                    "turn-sep", "segment", "messages", "msg", "role", "tool-call", "error", "mismatch",
                    "mismatch-note", "metrics", "detail", "facts", "fact", "verdict", "traj-row", "failed", "same",
                    "diff", "id", "text", "idx", "selected"}
ID_PATTERN = re.compile(r"(traj-\d+|traj-table|filters|f-[a-z-]+|worst|best|count|list|details|tip|problems)")
INT_ATTRS = {"data-id", "data-i", "data-index", "data-turn", "data-segment", "data-first"}
STYLE_PATTERN = re.compile(r"background:(#fff|hsl\(\d+,70%,82%\))")


def _assert_only_the_template(page: str, twin_page: str, title: str) -> None:
    got, twin = _parse(page), _parse(twin_page)
    assert got.elements == twin.elements, "the hostile page has elements or attributes its twin has not"
    names = {name for _, name, _ in got.attrs}
    assert names <= ALLOWED_ATTRS, names - ALLOWED_ATTRS
    assert not [n for n in names if n.startswith("on")]
    assert got.comments == []
    assert got.declarations == ["DOCTYPE html"]
    assert "".join(got.raw_text["script"]) == PAGE_JS
    assert "".join(got.raw_text["style"]) == PAGE_CSS
    assert "".join(got.raw_text["title"]) == title
    assert [tag for tag, _ in got.elements].count("script") == 1
    for tag, name, value in got.attrs:
        if name == "class":
            for token in (value or "").split():
                assert token in TEMPLATE_CLASSES or token.startswith("c-") or re.fullmatch(r"role-[\w-]+", token), (
                    tag, value)
            assert len([t for t in (value or "").split() if t.startswith("role-")]) <= 1, value
        elif name == "id":
            assert ID_PATTERN.fullmatch(value or ""), (tag, value)
        elif name in INT_ATTRS:
            assert re.fullmatch(r"-?\d+", value or ""), (tag, name, value)
        elif name == "style":
            assert STYLE_PATTERN.fullmatch(value or ""), (tag, value)


def _write(path, records) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def test_hostile_strings_in_every_field_add_no_markup(tmp_path):
    records = [_hostile_record(i, h) for i, h in enumerate(HOSTILE)]
    _write(tmp_path / "hostile.jsonl", records)
    _write(tmp_path / "twin.jsonl", _twin(records, {}))
    page = write_view(tmp_path / "hostile.jsonl").read_text(encoding="utf-8")
    twin_page = write_view(tmp_path / "twin.jsonl").read_text(encoding="utf-8")
    _assert_only_the_template(page, twin_page, "agentloop trajectories: hostile.jsonl")
    # The string ids are shown, marked, and listed: not rendered as markup, not dropped.
    assert page.count('class="tok bad"') == 2 * len(HOSTILE)  # prompt_ids[1], response_ids[0]
    # ... and expected_ids[1], actual_ids[2] in the mismatch table
    assert f"{4 * len(HOSTILE)} values of this file are not what agentloop writes" in page
    assert "record 0, prompt_ids[1]: not an integer token id" in page


def test_values_of_the_wrong_type_in_every_field_are_shown_marked_not_dropped(tmp_path):
    records = _typed_records()
    page = render_html(records, title="typed")
    _assert_only_the_template(page, render_html(_twin(records, {}), title="typed"), "typed")
    _, problems = check_records(records)
    assert f"{len(problems)} values of this file are not what agentloop writes" in page
    assert f"and {len(problems) - 50} more" in page  # the banner lists the first 50
    for field in ("trajectory_index", "segment_index", "rollout_n", "step", "reward", "advantage", "prompt_ids",
                  "response_ids", "response_mask", "rollout_log_probs", "prompt_tokens", "metrics", "messages",
                  "expected_ids", "actual_ids"):
        assert any(re.match(rf"record \d+, {field}(\[\d+\])?: not ", p) for p in problems), field


def test_the_tokenizer_path_decodes_the_good_ids_and_marks_the_bad(tmp_path, tokenizer):
    record = _hostile_record(0, HOSTILE[0])
    for key in ("prompt_tokens", "response_tokens", "expected_tokens", "actual_tokens"):
        record.pop(key)
    record["response_ids"] = [HOSTILE[0], 3, -5, 2**40]
    page = render_html([record], title="t", tokenizer=tokenizer)
    twin = render_html([_twin(record, {})], title="t", tokenizer=tokenizer)
    _assert_only_the_template(page, twin, "t")
    assert page.count('class="tok bad"') == 4  # the string id twice (prompt, response), -5, 2**40
    assert "response_ids[2]: not an integer token id: -5" in page


@pytest.mark.parametrize(("line", "match"), [
    ("[1, 2]", r"x.jsonl:2: a record must be a JSON object, got list"),
    ('"just a string"', r"x.jsonl:2: a record must be a JSON object, got str"),
    ("[" * 100_000 + "]" * 100_000, r"x.jsonl:2: nested too deeply"),
])
def test_lines_that_are_no_record_name_the_line(tmp_path, line, match):
    path = tmp_path / "x.jsonl"
    path.write_text('{"reward": 1}\n' + line + "\n")
    with pytest.raises(ValueError, match=match):
        load_records(path)
