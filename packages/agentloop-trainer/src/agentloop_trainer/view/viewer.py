"""``agentloop view``: one self-contained HTML page of trajectories (what the model saw).

The input is the JSONL that ``agentloop rollout`` writes, or a run folder whose trainer logged
``trajectories/step_<N>.jsonl`` (``trainer.log_trajectories_per_step``); both hold one record
per batch row (a segment of a trajectory) built by :func:`trajectory_records`. The page is
rendered here, in Python (the list here, each trajectory in
:mod:`~agentloop_trainer.view.trajectory_html`), so a test can count what it shows without a
browser; the inline script only sorts, filters and shows one trajectory at a time. Nothing is
fetched: the page works from ``file://`` and offline.

The JSONL may come from anyone, so the page takes nothing from it as markup: every value is
escaped for the context it lands in (``html_text``, text and quoted attributes alike), class
names and ids are made by the template, the inline script is a constant with no data in it (the
script reads only the escaped ``data-*`` attributes), and values of the wrong type are checked
by :mod:`~agentloop_trainer.view.viewer_input` and shown marked, never dropped. An image is
shown only from a ``data:image/...`` URL that :mod:`~agentloop_trainer.view.images` builds from
the thumbnail's re-encoded pixels.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from agentloop_trainer.view.images import record_images
from agentloop_trainer.view.trajectory_html import detail_html, fmt_reward, heat, token_texts
from agentloop_trainer.view.trajectory_html import html_text as _e
from agentloop_trainer.view.values import BadValue, as_int, is_int, is_number
from agentloop_trainer.view.viewer_assets import PAGE_CSS, PAGE_JS
from agentloop_trainer.view.viewer_input import TRAJECTORY_DIR, check_records, load_records

# -- records ----------------------------------------------------------------------------------


def trajectory_records(batch: Any, rows: Sequence[Mapping[str, Any]], tokenizer: Any = None,
                       which: Iterable[int] | None = None, step: int | None = None,
                       advantages: Sequence[float] | None = None) -> list[dict[str, Any]]:
    """One JSON-ready record per batch row: token ids, mask, log-probs, reward, messages, metrics,
    ``trajectory_index``/``segment_index``, with a tokenizer each token's decoded text and, for a
    row with images, ``images``: each image's thumbnail, digest, size, token count, where it
    entered and where its tokens start (:func:`~agentloop_trainer.view.images.record_images`).

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
            record["prompt_tokens"] = token_texts(tokenizer, prompt_ids)
            record["response_tokens"] = token_texts(tokenizer, response_ids)
        multi_modal = batch.multi_modal_data[b] if b < len(getattr(batch, "multi_modal_data", None) or []) else None
        record.update(record_images(multi_modal, record["messages"], prompt_ids + response_ids, tokenizer))
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


_COLUMNS = (("step", "step"), ("group", "group"), ("sample", "sample"), ("reward", "reward"), ("failed", "failed"),
            ("length", "tokens"), ("tools", "tool calls"), ("segments", "segments"), ("verdict", "sanity"))


def _cell(key: str, value: Any) -> Any:
    if value is None or value is False:
        return ""
    if value is True:
        return "yes"
    return fmt_reward(value, ".3g") if key == "reward" else value


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
    details = "".join(detail_html(i, segs, s, tokenizer) for i, (segs, s) in enumerate(zip(trajectories, summaries, strict=True)))
    failed = sum(s["failed"] for s in summaries)
    # Only a page with images has image markers: a text-only page is as it was.
    image_legend = '<span class="tok img">[image]</span>' if any(r["images"] for r in records) else ""
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{_e(title)}</title>
<style>{PAGE_CSS}</style></head>
<body>
<header><h1>{_e(title)}</h1><span class="muted">{len(summaries)} trajectories, {len(records)} segments, {failed} failed</span>
<span class="legend"><span class="tok gen" style="background:#fff">generated (mask 1)</span><span class="tok ctx">tool / user (mask 0)</span>
<span class="tok glue">template glue</span><span class="tok prompt">prompt</span>{image_legend}
<span class="tok gen" style="background:{heat(0.0)}">p=1</span><span class="tok gen" style="background:{heat(math.log(0.5))}">p=.5</span>
<span class="tok gen" style="background:{heat(-30.0)}">p=0</span></span></header>
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
