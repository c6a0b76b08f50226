"""``agentloop view``: one self-contained HTML page of trajectories (what the model saw).

The input is the JSONL that ``agentloop rollout`` writes, or a run folder whose trainer logged
``trajectories/step_<N>.jsonl`` (``trainer.log_trajectories_per_step``); both hold one record
per batch row (a segment of a trajectory) built by :func:`trajectory_records`. The page is
rendered here, in Python, so a test can count what it shows without a browser; the inline
script only sorts, filters and shows one trajectory at a time. Nothing is fetched: the page
works from ``file://`` and offline.

The JSONL may come from anyone, so the page takes nothing from it as markup: every value is
escaped for the context it lands in (:func:`_e`, text and quoted attributes alike), class names
and ids are made by the template, the inline script is a constant with no data in it (the
script reads only the escaped ``data-*`` attributes), and values of the wrong type are checked
by :mod:`~agentloop_trainer.view.viewer_input` and shown marked, never dropped.
"""

from __future__ import annotations

import html
import json
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from agentloop_trainer.view.viewer_assets import PAGE_CSS, PAGE_JS
from agentloop_trainer.view.viewer_input import (
    TRAJECTORY_DIR,
    BadValue,
    as_int,
    check_records,
    is_int,
    is_number,
    load_records,
)

_MISMATCH_ROWS = 40  # tokens shown from the first difference on


# -- records ----------------------------------------------------------------------------------


def _token_texts(tokenizer: Any, ids: Sequence[Any]) -> list[str | None] | None:
    if tokenizer is None or not len(ids):
        return None if tokenizer is None else []
    valid = [i for i in ids if is_int(i)]  # a bad id (a checked record's BadValue) is shown marked
    texts = iter(str(t) for t in tokenizer.batch_decode([[int(i)] for i in valid])) if valid else iter(())
    return [next(texts) if is_int(i) else None for i in ids]


def trajectory_records(batch: Any, rows: Sequence[Mapping[str, Any]], tokenizer: Any = None,
                       which: Iterable[int] | None = None, step: int | None = None,
                       advantages: Sequence[float] | None = None) -> list[dict[str, Any]]:
    """One JSON-ready record per batch row: token ids, mask, log-probs, reward, messages, metrics,
    ``trajectory_index``/``segment_index`` and, with a tokenizer, each token's decoded text.

    Args:
        batch: The :class:`~agentloop_core.batch.RolloutBatch`.
        rows: The loop rows rolled out (``trajectory_index`` points into them).
        tokenizer: Decodes ``prompt_tokens``/``response_tokens``; None leaves them out.
        which: Batch rows to keep (default: all).
        step: The training step, recorded when given.
        advantages: Per-row advantages, recorded when given.

    Returns:
        The records, in batch order.
    """
    P = batch.prompts.shape[1]
    out = []
    for b in (range(len(batch)) if which is None else which):
        t = int(batch.trajectory_index[b])
        row = rows[t]
        attn = batch.attention_mask[b]
        n = int(attn[P:].sum())
        prompt_ids = batch.prompts[b][attn[:P] == 1].tolist()
        response_ids = batch.responses[b][:n].tolist()
        record: dict[str, Any] = {
            "group_id": row["group_id"], "rollout_n": row["rollout_n"], "ground_truth": row.get("ground_truth"),
            "trajectory_index": t, "segment_index": int(batch.segment_index[b]),
            "data_source": row.get("data_source"),
            "reward": float(batch.rewards[b]), "failed": bool(batch.failed[b]),
            "num_turns": int(batch.num_turns[b]),
            "prompt_ids": prompt_ids, "response_ids": response_ids,
            "response_mask": batch.response_mask[b][:n].tolist(),
            "rollout_log_probs": None if batch.rollout_log_probs is None else [round(float(x), 6) for x in batch.rollout_log_probs[b][:n]],
            "messages": batch.extra_fields[b].get("messages"),
            "metrics": batch.sample_metrics[b] if batch.sample_metrics else {},
            "reported_metrics": batch.extra_fields[b].get("reported_metrics", []),
        }
        if step is not None:
            record["step"] = int(step)
        if advantages is not None:
            record["advantage"] = round(float(advantages[b]), 6)
        if tokenizer is not None:
            record["prompt_tokens"] = _token_texts(tokenizer, prompt_ids)
            record["response_tokens"] = _token_texts(tokenizer, response_ids)
        out.append(record)
    return out


def write_jsonl(records: Iterable[Mapping[str, Any]], path: str | Path) -> Path:
    """Write records one JSON object a line (``default=str``: what a tool reported is kept even
    when it is not JSON, a path or a date)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as fh:
        for record in records:
            fh.write(json.dumps(record, default=str) + "\n")
    return path


def sample_rows(batch: Any, k: int) -> list[int]:
    """Batch rows to log for a step: every segment of the first ``k`` trajectories (by index) and
    of every failed one, in batch order."""
    trajectories = sorted(set(batch.trajectory_index.tolist()))
    keep = set(trajectories[:max(k, 0)]) | set(batch.trajectory_index[batch.failed].tolist())
    return [b for b in range(len(batch)) if int(batch.trajectory_index[b]) in keep]


def step_trajectory_records(batch: Any, rows: Sequence[Mapping[str, Any]], tokenizer: Any, k: int, step: int,
                            advantages: Sequence[float] | None = None) -> list[dict[str, Any]]:
    """A training step's records to log: :func:`trajectory_records` of :func:`sample_rows`."""
    which = sample_rows(batch, k)
    return trajectory_records(batch, rows, tokenizer, which, step=step, advantages=advantages) if which else []


def step_trajectory_path(run_dir: str | Path, step: int) -> Path:
    """``<run_dir>/trajectories/step_<step>.jsonl``."""
    return Path(run_dir) / TRAJECTORY_DIR / f"step_{step}.jsonl"


def write_step_trajectories(run_dir: str | Path, step: int, batch: Any, rows: Sequence[Mapping[str, Any]],
                            tokenizer: Any, k: int, advantages: Sequence[float] | None = None) -> Path | None:
    """The trainer's hook: :func:`step_trajectory_records` to :func:`step_trajectory_path`
    (None when there is nothing to write)."""
    records = step_trajectory_records(batch, rows, tokenizer, k, step, advantages)
    return write_jsonl(records, step_trajectory_path(run_dir, step)) if records else None


# -- grouping and summaries -------------------------------------------------------------------


def group_trajectories(records: Sequence[Mapping[str, Any]]) -> list[list[Mapping[str, Any]]]:
    """Records grouped into trajectories (a trajectory's segments in ``segment_index`` order), in
    first-seen order. A trajectory is ``(step, trajectory_index)``, else ``(step, group_id,
    rollout_n)`` for records without an index."""
    groups: dict[tuple, list[Mapping[str, Any]]] = {}
    for i, r in enumerate(records):
        if not _hashable(r.get("trajectory_index"), r.get("group_id"), r.get("rollout_n"), r.get("step")):
            groups.setdefault(("row", i), []).append(r)  # an unchecked record: a list as its index
            continue
        if r.get("trajectory_index") is not None:
            key: tuple = (r.get("step"), "t", r["trajectory_index"])
        elif r.get("group_id") is not None:
            key = (r.get("step"), "g", r.get("group_id"), r.get("rollout_n"))
        else:
            key = ("row", i)
        groups.setdefault(key, []).append(r)
    return [sorted(segs, key=lambda r: as_int(r.get("segment_index"))) for segs in groups.values()]


def _hashable(*values: Any) -> bool:
    try:
        hash(values)
    except TypeError:
        return False
    return True


def _tool_call_count(segments: Sequence[Mapping[str, Any]]) -> int:
    last = segments[-1]
    count = (last.get("metrics") or {}).get("tool_calls")
    if isinstance(count, (int, float)) and not isinstance(count, bool):
        return int(count)
    return sum(len(calls) if isinstance(calls := m.get("tool_calls") or [], list) else 1
               for m in (last.get("messages") or []) if isinstance(m, Mapping))


def verdict(segments: Sequence[Mapping[str, Any]]) -> str:
    """The tokenization sanity check's verdict over a trajectory's segments."""
    metrics = [s.get("metrics") or {} for s in segments]
    if any(m.get("tokenization_mismatch") for m in metrics) or any(s.get("expected_ids") is not None for s in segments):
        return "mismatch"
    if any(m.get("tokenization_mismatch_ignored") for m in metrics):
        return "mismatch ignored"
    if any(m.get("tokenization_noncanonical") for m in metrics):
        return "ok (non-canonical)"
    return "ok"


def summarize(segments: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The list view's columns of one trajectory."""
    last = segments[-1]
    return {
        "step": last.get("step"), "group": str(last.get("group_id", "")), "sample": last.get("rollout_n"),
        "reward": _reward(last.get("reward")), "failed": any(bool(s.get("failed")) for s in segments),
        "length": sum(len(s.get("response_ids") or []) for s in segments),
        "generated": sum(sum(1 for m in (s.get("response_mask") or []) if is_int(m) and m == 1) for s in segments),
        "tools": _tool_call_count(segments), "segments": len(segments), "verdict": verdict(segments),
    }


def _reward(value: Any) -> float | BadValue:
    if value is None:
        return 0.0
    return float(value) if is_number(value) else value if isinstance(value, BadValue) else BadValue(str(value), "")


# -- HTML -------------------------------------------------------------------------------------

# Lone surrogates cannot be written as UTF-8 and NUL is a parse error in HTML: both come out as
# the replacement character, like other broken text.
_UNWRITABLE = re.compile("[\ud800-\udfff\x00]")


def _e(value: Any) -> str:
    """``value`` as text safe in element content and in a quoted attribute value (``&<>"'``
    escaped, unwritable characters replaced)."""
    return html.escape(_UNWRITABLE.sub("\ufffd", str(value)), quote=True)


def _class_token(value: Any) -> str:
    """A CSS class suffix from data (a message role): letters, digits, ``-`` and ``_`` only,
    so a value cannot add classes of its own."""
    token = re.sub(r"[^A-Za-z0-9_-]", "", str(value))[:32]
    return token or "other"


def _fmt_reward(value: Any, spec: str) -> str:
    return format(value, spec) if isinstance(value, float) else str(value)


def _heat(lp: float) -> str:
    """Background of a generated token: red (unlikely) to green (likely) by probability."""
    p = math.exp(min(0.0, lp)) if math.isfinite(lp) else 0.0
    return f"hsl({round(120 * p)},70%,82%)"


def _shown(text: str | None, token_id: int) -> str:
    if text is None:
        return f"[{token_id}]"
    if text == "":
        return "\u2205"
    return text.replace("\n", "\u21b5\n")


_GLUE_EDGES = (("<|", "|>"), ("<", ">"))


def _is_glue(text: str | None) -> bool:
    """Template glue: a special token such as ``<|im_start|>`` (what the data can tell apart from
    tool and user text without the template's spans)."""
    return isinstance(text, str) and any(text.startswith(a) and text.endswith(b) and len(text) > len(a) + len(b)
                                    for a, b in _GLUE_EDGES) and " " not in text


def _bad_token(index: int, token_id: Any, values: Sequence[Any]) -> str:
    """A token some value of which is not what agentloop writes: shown, with what is wrong."""
    why = "; ".join(f"{v.why}: {v.raw}" for v in values if isinstance(v, BadValue))
    shown = token_id.raw if isinstance(token_id, BadValue) else str(token_id)
    return f'<span class="tok bad" data-i="{int(index)}" title="{_e(f"#{index} {why}")}">\u26a0 {_e(shown)}</span>'


def _token(kind: str, token_id: Any, text: Any, index: int, lp: Any = None, mask: Any = None) -> str:
    if any(isinstance(v, BadValue) for v in (token_id, text, lp, mask)):
        return _bad_token(index, token_id, [token_id, text, lp, mask])
    label = {"gen": "generated by the model", "ctx": "tool / user (mask 0)", "glue": "template glue (mask 0)",
             "prompt": "prompt"}[kind]
    title = f"#{index} id {token_id} \u00b7 {label}"
    attrs = f' data-id="{int(token_id)}" data-i="{int(index)}"'
    style = ""
    if lp is not None:
        lp = float(lp)
        title += f" \u00b7 logprob {lp:.4f} (p={math.exp(min(lp, 0.0)):.3f})"
        attrs += f' data-lp="{lp:.4f}"'
        style = f' style="background:{_heat(lp)}"'
    return f'<span class="tok {kind}"{attrs} title="{_e(title)}"{style}>{_e(_shown(text, token_id))}</span>'


def _tokens_html(record: Mapping[str, Any], tokenizer: Any) -> str:
    prompt_ids = list(record.get("prompt_ids") or [])
    response_ids = list(record.get("response_ids") or [])
    mask = list(record.get("response_mask") or [0] * len(response_ids))
    lps = record.get("rollout_log_probs")
    ptexts = _texts(record.get("prompt_tokens") or _token_texts(tokenizer, prompt_ids), len(prompt_ids))
    rtexts = _texts(record.get("response_tokens") or _token_texts(tokenizer, response_ids), len(response_ids))
    # The prompt (system text, tool schemas) is often most of a trajectory: folded, so the
    # response is on screen.
    parts = [f'<div class="stream"><details class="prompt-part"><summary>prompt: {len(prompt_ids)} tokens</summary>']
    parts += [_token("glue" if _is_glue(t) else "prompt", i, t, k) for k, (i, t) in enumerate(zip(prompt_ids, ptexts, strict=False))]
    parts.append("</details>")
    turn, previous = 0, None
    for k, (i, m, t) in enumerate(zip(response_ids, mask, rtexts, strict=False)):
        if isinstance(m, BadValue):
            parts.append(_token("ctx", i, t, len(prompt_ids) + k, mask=m))
            continue
        if m != previous:
            turn += 1
            who = "model" if m else "tool / user"
            parts.append(f'<span class="turn-sep" data-turn="{turn}">turn {turn}: {who}</span>')
            previous = m
        if m:
            lp = lps[k] if lps is not None and k < len(lps) else None
            parts.append(_token("gen", i, t, len(prompt_ids) + k, lp))
        else:
            parts.append(_token("glue" if _is_glue(t) else "ctx", i, t, len(prompt_ids) + k))
    parts.append("</div>")
    return "".join(parts)


def _texts(texts: Sequence[Any] | None, n: int) -> list[Any]:
    """One text (or None: the id is shown) per token, whatever the length of ``texts``."""
    texts = list(texts or [])
    return texts[:n] + [None] * (n - len(texts))


def _first_difference(a: Sequence[int], b: Sequence[int]) -> int:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return min(len(a), len(b))


def _mismatch_html(record: Mapping[str, Any], tokenizer: Any) -> str:
    expected = record.get("expected_ids")
    if expected is None:
        if (record.get("metrics") or {}).get("tokenization_mismatch"):
            return ('<div class="mismatch-note">The sanity check reported a tokenization mismatch '
                    "(metrics.tokenization_mismatch); this record carries no expected ids to compare.</div>")
        return ""
    actual = record.get("actual_ids")
    if actual is None:
        actual = list(record.get("prompt_ids") or []) + list(record.get("response_ids") or [])
    etexts = _texts(record.get("expected_tokens") or _token_texts(tokenizer, expected), len(expected))
    atexts = _texts(record.get("actual_tokens") or _token_texts(tokenizer, actual), len(actual))
    first = _first_difference(expected, actual)
    lo = max(0, first - 2)
    rows = []
    for k in range(lo, min(max(len(expected), len(actual)), first + _MISMATCH_ROWS)):
        e = (expected[k], etexts[k]) if k < len(expected) else None
        a = (actual[k], atexts[k]) if k < len(actual) else None
        cls = "diff" if e is None or a is None or e[0] != a[0] else "same"
        cells = "".join(
            f'<td class="id">{_e(x[0])}</td><td class="text">{_e(_shown(_text(x[1]), x[0]))}</td>' if x is not None
            else '<td class="id">-</td><td class="text">(none)</td>' for x in (e, a))
        rows.append(f'<tr class="{cls}" data-i="{k}"><td class="idx">{k}</td>{cells}</tr>')
    return (f'<div class="mismatch" data-first="{first}"><h4>Tokenization mismatch: expected (template '
            f're-tokenized) vs actual (trajectory) from token {first}</h4><table><thead><tr><th>#</th>'
            '<th colspan="2">expected</th><th colspan="2">actual</th></tr></thead><tbody>'
            + "".join(rows) + "</tbody></table></div>")


def _text(text: Any) -> str | None:
    return None if text is None else str(text)


def _content(content: Any) -> str:
    if isinstance(content, str):
        return content
    return json.dumps(content, default=str, indent=1)


def _messages_html(messages: Any) -> str:
    if not messages:
        return '<p class="muted">No chat messages recorded.</p>'
    parts = ['<div class="messages">']
    for m in messages:
        if not isinstance(m, Mapping):
            parts.append(f'<div class="msg"><pre>{_e(_content(m))}</pre></div>')
            continue
        role = str(m.get("role", "?"))
        parts.append(f'<div class="msg role-{_class_token(role)}"><div class="role">{_e(role)}'
                     + (f' <span class="muted">{_e(m["name"])}</span>' if m.get("name") else "") + "</div>")
        if m.get("content") not in (None, ""):
            parts.append(f"<pre>{_e(_content(m.get('content')))}</pre>")
        calls = m.get("tool_calls") or []
        for call in calls if isinstance(calls, list) else [calls]:
            fn = call.get("function", call) if isinstance(call, Mapping) else {}
            args = fn.get("arguments") if isinstance(fn, Mapping) else call
            args = args if isinstance(args, str) else json.dumps(args, default=str)
            name = fn.get("name", "?") if isinstance(fn, Mapping) else "?"
            parts.append(f'<div class="tool-call">tool call: <b>{_e(name)}</b>({_e(args)})</div>')
        parts.append("</div>")
    parts.append("</div>")
    return "".join(parts)


def _metrics_html(record: Mapping[str, Any]) -> str:
    metrics = dict(record.get("metrics") or {})
    if not metrics:
        return ""
    cells = "".join(f"<tr><td>{_e(k)}</td><td>{_e(round(v, 4) if isinstance(v, float) else v)}</td></tr>"
                    for k, v in sorted(metrics.items()))
    return f'<table class="metrics">{cells}</table>'


def _detail_html(index: int, segments: Sequence[Mapping[str, Any]], summary: Mapping[str, Any], tokenizer: Any) -> str:
    last = segments[-1]
    facts = [("step", summary["step"]), ("group", summary["group"]), ("sample", summary["sample"]),
             ("reward", _fmt_reward(summary["reward"], ".4g")), ("failed", summary["failed"]),
             ("data source", last.get("data_source")), ("ground truth", last.get("ground_truth")),
             ("advantage", last.get("advantage")), ("segments", summary["segments"]),
             ("tool calls", summary["tools"]), ("tokens", f"{summary['length']} ({summary['generated']} generated)")]
    fact_html = "".join(f'<span class="fact"><b>{_e(k)}</b> {_e(v)}</span>' for k, v in facts if v is not None)
    verdict_cls = "bad" if summary["verdict"] == "mismatch" else "good"
    parts = [f'<section class="detail" id="traj-{index}" data-index="{index}" hidden>',
             f'<h2>Trajectory {index}</h2><div class="facts">{fact_html}<span class="fact verdict {verdict_cls}">'
             f'<b>sanity check</b> {_e(summary["verdict"])}</span></div>']
    error = (last.get("metrics") or {}).get("error")
    if error:
        parts.append(f'<pre class="error">{_e(error)}</pre>')
    parts.append("<h3>Messages</h3>" + _messages_html(last.get("messages")))
    for seg in segments:
        k = seg.get("segment_index") or 0
        parts.append(f'<div class="segment" data-segment="{as_int(k)}"><h3>Segment {_e(k)}: tokens</h3>'
                     + _mismatch_html(seg, tokenizer) + _tokens_html(seg, tokenizer)
                     + "<details><summary>metrics</summary>" + _metrics_html(seg) + "</details></div>")
    parts.append("</section>")
    return "".join(parts)


_COLUMNS = (("step", "step"), ("group", "group"), ("sample", "sample"), ("reward", "reward"), ("failed", "failed"),
            ("length", "tokens"), ("tools", "tool calls"), ("segments", "segments"), ("verdict", "sanity"))


def _cell(key: str, value: Any) -> Any:
    if value is None or value is False:
        return ""
    if value is True:
        return "yes"
    return _fmt_reward(value, ".3g") if key == "reward" else value


def _problems_html(problems: Sequence[str]) -> str:
    if not problems:
        return ""
    shown = "".join(f"<li>{_e(p)}</li>" for p in problems[:_PROBLEMS_SHOWN])
    more = f"<li>and {len(problems) - _PROBLEMS_SHOWN} more</li>" if len(problems) > _PROBLEMS_SHOWN else ""
    return (f'<details id="problems" open><summary>\u26a0 {len(problems)} values of this file are not what '
            "agentloop writes there; they are shown marked \u26a0</summary><ul>" + shown + more + "</ul></details>")


_PROBLEMS_SHOWN = 50


def _row_html(index: int, s: Mapping[str, Any]) -> str:
    data = " ".join(f'data-{k}="{_e(int(v) if isinstance(v, bool) else ("" if v is None else v))}"'
                    for k, v in s.items())
    cells = "".join(f'<td class="c-{k}">{_e(_cell(k, s[k]))}</td>' for k, _ in _COLUMNS)
    return f'<tr class="traj-row{" failed" if s["failed"] else ""}" data-index="{index}" {data}>{cells}</tr>'


def render_html(records: Sequence[Mapping[str, Any]], title: str = "agentloop trajectories", tokenizer: Any = None) -> str:
    """The page: a sortable, filterable list of trajectories and, per trajectory, its messages,
    token stream (coloured by mask, log-prob heat, turn and segment boundaries), reward, metrics,
    sanity-check verdict and, on a mismatch with expected ids, both token streams side by side."""
    records, problems = check_records(records)
    trajectories = group_trajectories(records)
    summaries = [summarize(segs) for segs in trajectories]
    head = "".join(f'<th data-key="{k}">{_e(label)}</th>' for k, label in _COLUMNS)
    rows = "".join(_row_html(i, s) for i, s in enumerate(summaries))
    details = "".join(_detail_html(i, segs, s, tokenizer) for i, (segs, s) in enumerate(zip(trajectories, summaries, strict=True)))
    failed = sum(s["failed"] for s in summaries)
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{_e(title)}</title>
<style>{PAGE_CSS}</style></head>
<body>
<header><h1>{_e(title)}</h1><span class="muted">{len(summaries)} trajectories, {len(records)} segments, {failed} failed</span>
<span class="legend"><span class="tok gen" style="background:#fff">generated (mask 1)</span><span class="tok ctx">tool / user (mask 0)</span>
<span class="tok glue">template glue</span><span class="tok prompt">prompt</span>
<span class="tok gen" style="background:{_heat(0.0)}">p=1</span><span class="tok gen" style="background:{_heat(math.log(0.5))}">p=.5</span>
<span class="tok gen" style="background:{_heat(-30.0)}">p=0</span></span></header>
{_problems_html(problems)}<div id="filters">
<label>group <input id="f-group" type="text" placeholder="e.g. train-3-0"></label>
<label>failure <select id="f-failed"><option value="">all</option><option value="1">failed</option><option value="0">ok</option></select></label>
<label>reward &ge; <input id="f-reward-min" type="number" step="any"></label>
<label>reward &le; <input id="f-reward-max" type="number" step="any"></label>
<label>tokens &ge; <input id="f-length-min" type="number"></label>
<label>tool calls &ge; <input id="f-tools-min" type="number"></label>
<label>segments &ge; <input id="f-segments-min" type="number"></label>
<label>sanity <select id="f-verdict"><option value="">all</option><option value="mismatch">mismatch</option></select></label>
<button id="worst" type="button">worst first</button><button id="best" type="button">best first</button>
<span id="count" class="muted"></span></div>
<main><div id="list"><table id="traj-table"><thead><tr>{head}</tr></thead><tbody>{rows}</tbody></table></div>
<div id="details">{details}</div></main>
<div id="tip" hidden></div>
<script>{PAGE_JS}</script>
</body></html>
"""


def write_view(path: str | Path, out: str | Path | None = None, tokenizer: Any = None) -> Path:
    """Render the trajectories at ``path`` (a JSONL or a run folder) to ``out`` (default: ``view.html``
    in the run folder, or next to the JSONL with its name)."""
    path = Path(path)
    records = load_records(path)
    if out is None:
        out = path / "view.html" if path.is_dir() else path.with_suffix(".html")
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(render_html(records, title=f"agentloop trajectories: {path.resolve().name}", tokenizer=tokenizer),
                   encoding="utf-8")
    return out


__all__ = ["TRAJECTORY_DIR", "group_trajectories", "load_records", "render_html", "sample_rows", "summarize",
           "step_trajectory_path", "step_trajectory_records", "trajectory_records", "verdict", "write_jsonl",
           "write_step_trajectories", "write_view"]
