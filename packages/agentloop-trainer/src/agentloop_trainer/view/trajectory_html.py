"""One trajectory's part of the viewer's page: its facts, messages (images as thumbnails where
they entered), each segment's token stream (each run of an image's tokens as one marker) and, on a
tokenization mismatch, expected and actual tokens side by side.

Records here are checked ones (:func:`~agentloop_trainer.view.viewer_input.check_records`):
every value from the file is escaped with :func:`html_text` for the context it lands in, class
names and ids are made here, and an image is shown only from the ``data:`` URL that
:mod:`~agentloop_trainer.view.images` built from re-encoded pixels.
"""

from __future__ import annotations

import html
import json
import math
import re
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

from agentloop_trainer.view.images import ShownImage, image_part_digest
from agentloop_trainer.view.values import BadValue, as_int, is_int

_MISMATCH_ROWS = 40  # tokens shown from the first difference on

# Lone surrogates cannot be written as UTF-8 and NUL is a parse error in HTML: both come out as
# the replacement character, like other broken text.
_UNWRITABLE = re.compile("[\ud800-\udfff\x00]")


def html_text(value: Any) -> str:
    """``value`` as text safe in element content and in a quoted attribute value (``&<>"'``
    escaped, unwritable characters replaced)."""
    return html.escape(_UNWRITABLE.sub("\ufffd", str(value)), quote=True)


_e = html_text


def token_texts(tokenizer: Any, ids: Sequence[Any]) -> list[str | None] | None:
    """Each id's decoded text (None for a bad id, shown marked); None without a tokenizer."""
    if tokenizer is None or not len(ids):
        return None if tokenizer is None else []
    valid = [i for i in ids if is_int(i)]  # a bad id (a checked record's BadValue) is shown marked
    texts = iter(str(t) for t in tokenizer.batch_decode([[int(i)] for i in valid])) if valid else iter(())
    return [next(texts) if is_int(i) else None for i in ids]


def _class_token(value: Any) -> str:
    """A CSS class suffix from data (a message role): letters, digits, ``-`` and ``_`` only,
    so a value cannot add classes of its own."""
    token = re.sub(r"[^A-Za-z0-9_-]", "", str(value))[:32]
    return token or "other"


def fmt_reward(value: Any, spec: str) -> str:
    return format(value, spec) if isinstance(value, float) else str(value)


def heat(lp: float) -> str:
    """Background of a generated token: red (unlikely) to green (likely) by probability."""
    p = math.exp(min(0.0, lp)) if math.isfinite(lp) else 0.0
    return f"hsl({round(120 * p)},70%,82%)"


# -- images -----------------------------------------------------------------------------------


class _Images:
    """A trajectory's images, numbered 1.. in the order they first appear over its segments (an
    image a later segment's prompt repeats keeps its number)."""

    def __init__(self, segments: Sequence[Mapping[str, Any]]) -> None:
        self.by_key: dict[tuple[Any, int], int] = {}
        self.shown: dict[int, ShownImage] = {}
        self.per_segment: list[list[int]] = []
        self.placed: set[int] = set()
        for seg in segments:
            numbers, seen = [], Counter()
            for image in seg.get("images") or []:
                key = (image.digest, seen[image.digest]) if isinstance(image.digest, str) else ("bad", id(image))
                seen[image.digest] += 1
                number = self.by_key.setdefault(key, len(self.by_key) + 1)
                if number not in self.shown or (self.shown[number].src is None and image.src is not None):
                    self.shown[number] = image  # the entry with a thumbnail, where one has
                numbers.append(number)
            self.per_segment.append(numbers)

    def place(self, digest: str, occurrence: int) -> int | None:
        """The number of the ``occurrence``-th image part naming ``digest`` in the messages."""
        number = self.by_key.get((digest, occurrence))
        if number is None:  # a part without its own entry: the same pixels, entered before
            number = next((n for (d, _), n in self.by_key.items() if d == digest), None)
        if number is not None:
            self.placed.add(number)
        return number


def _size_text(image: ShownImage) -> str:
    w, h = image.width, image.height
    if w is None or h is None:
        return "size unknown"
    return f"{_e(w)}x{_e(h)}"  # a bad value shows marked


def _image_label(number: int, image: ShownImage) -> str:
    n = image.num_tokens
    tokens = "" if n is None else f", {_e(n)} token{'' if n == 1 else 's'}"
    return f"image {number}: {_size_text(image)}{tokens}"


def _figure_html(number: int, image: ShownImage, where: bool = False) -> str:
    caption = _image_label(number, image)
    if where and image.message_index is not None:
        caption += f", entered at message {_e(image.message_index)}" + (f" ({_e(image.role)})" if image.role else "")
    title = _e(f"{image.digest}")
    if isinstance(image.src, str):
        body = f'<img class="thumb-img" src="{_e(image.src)}" alt="image {number}" title="{title}">'
        cls = "thumb"
    elif isinstance(image.src, BadValue):
        body = f'<span class="tok bad" title="{_e(image.src.why)}">\u26a0 {_e(image.src.raw)}</span>'
        cls = "thumb bad"
    else:
        body = '<span class="no-thumb">no thumbnail in this file</span>'
        cls = "thumb none"
    return f'<figure class="{cls}" data-image="{number}">{body}<figcaption>{caption}</figcaption></figure>'


def _image_marker(number: int, image: ShownImage, run: int, token_id: Any) -> str:
    """The marker of the ``run``-th run of an image's tokens: the first one labels the image, a
    further one (a tile of an Idefics3 image) says whose run it is."""
    start, n = image.token_runs[run]
    count = len(image.token_runs)
    where = f" (run {run + 1} of {count})" if count > 1 else ""
    title = f"{image.digest} \u00b7 tokens #{start}..#{start + n - 1}: id {token_id} \u00d7 {n}{where}"
    attrs = f'data-image="{number}" data-i="{start}" data-n="{n}" title="{_e(title)}"'
    if run == 0:
        return f'<span class="tok img" {attrs}>[{_image_label(number, image)}]</span>'
    return f'<span class="tok img more" {attrs}>[image {number}, run {run + 1} of {count}]</span>'


def _unplaced_html(images: _Images) -> str:
    left = [n for n in sorted(images.shown) if n not in images.placed]
    if not left:
        return ""
    return ('<div class="images-unplaced"><h4>Images not in the messages above</h4>'
            + "".join(_figure_html(n, images.shown[n], where=True) for n in left) + "</div>")


# -- tokens -----------------------------------------------------------------------------------


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
        style = f' style="background:{heat(lp)}"'
    return f'<span class="tok {kind}"{attrs} title="{_e(title)}"{style}>{_e(_shown(text, token_id))}</span>'


def _tokens_html(record: Mapping[str, Any], tokenizer: Any, numbers: Sequence[int]) -> str:
    prompt_ids = list(record.get("prompt_ids") or [])
    response_ids = list(record.get("response_ids") or [])
    mask = list(record.get("response_mask") or [0] * len(response_ids))
    lps = record.get("rollout_log_probs")
    ptexts = _texts(record.get("prompt_tokens") or token_texts(tokenizer, prompt_ids), len(prompt_ids))
    rtexts = _texts(record.get("response_tokens") or token_texts(tokenizer, response_ids), len(response_ids))
    # Each run of an image's tokens (hundreds of one id) is one marker, the image's label at its
    # first run: the runs were checked against the ids.
    runs = {start: (number, image, j) for number, image in zip(numbers, record.get("images") or [], strict=False)
            for j, (start, _) in enumerate(image.token_runs)}
    P = len(prompt_ids)
    # The prompt (system text, tool schemas) is often most of a trajectory: folded, so the
    # response is on screen.
    parts = [f'<div class="stream"><details class="prompt-part"><summary>prompt: {P} tokens</summary>']
    k = 0
    while k < P:
        if k in runs:
            number, image, j = runs[k]
            parts.append(_image_marker(number, image, j, prompt_ids[k]))
            k += image.token_runs[j][1]
            continue
        parts.append(_token("glue" if _is_glue(ptexts[k]) else "prompt", prompt_ids[k], ptexts[k], k))
        k += 1
    parts.append("</details>")
    turn, previous, k = 0, None, 0
    while k < len(response_ids):
        i, m, t = response_ids[k], mask[k] if k < len(mask) else 0, rtexts[k]
        if isinstance(m, BadValue):
            parts.append(_token("ctx", i, t, P + k, mask=m))
            k += 1
            continue
        if m != previous:
            turn += 1
            who = "model" if m else "tool / user"
            parts.append(f'<span class="turn-sep" data-turn="{turn}">turn {turn}: {who}</span>')
            previous = m
        if P + k in runs:
            number, image, j = runs[P + k]
            parts.append(_image_marker(number, image, j, i))
            k += image.token_runs[j][1]
            continue
        if m:
            lp = lps[k] if lps is not None and k < len(lps) else None
            parts.append(_token("gen", i, t, P + k, lp))
        else:
            parts.append(_token("glue" if _is_glue(t) else "ctx", i, t, P + k))
        k += 1
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
    etexts = _texts(record.get("expected_tokens") or token_texts(tokenizer, expected), len(expected))
    atexts = _texts(record.get("actual_tokens") or token_texts(tokenizer, actual), len(actual))
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


# -- messages ---------------------------------------------------------------------------------


def _content(content: Any) -> str:
    if isinstance(content, str):
        return content
    return json.dumps(content, default=str, indent=1)


def _content_html(content: Any, images: _Images, seen: Counter) -> str:
    """A message's content: text, and a list's parts in order (an image part as its thumbnail)."""
    if not isinstance(content, list):
        return f"<pre>{_e(_content(content))}</pre>"
    parts = []
    for part in content:
        digest = image_part_digest(part)
        if digest is not None:
            number = images.place(digest, seen[digest])
            seen[digest] += 1
            parts.append(_figure_html(number, images.shown[number]) if number is not None else
                         f'<figure class="thumb none"><span class="no-thumb">{_e(digest)}</span>'
                         "<figcaption>an image not in this file</figcaption></figure>")
        elif isinstance(part, Mapping) and part.get("type") == "text" and isinstance(part.get("text"), str):
            parts.append(f"<pre>{_e(part['text'])}</pre>")
        else:
            parts.append(f"<pre>{_e(_content(part))}</pre>")
    return "".join(parts)


def _messages_html(messages: Any, images: _Images) -> str:
    if not messages:
        return '<p class="muted">No chat messages recorded.</p>'
    parts, seen = ['<div class="messages">'], Counter()
    for m in messages:
        if not isinstance(m, Mapping):
            parts.append(f'<div class="msg"><pre>{_e(_content(m))}</pre></div>')
            continue
        role = str(m.get("role", "?"))
        parts.append(f'<div class="msg role-{_class_token(role)}"><div class="role">{_e(role)}'
                     + (f' <span class="muted">{_e(m["name"])}</span>' if m.get("name") else "") + "</div>")
        if m.get("content") not in (None, ""):
            parts.append(_content_html(m.get("content"), images, seen))
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


def _left_out_html(record: Mapping[str, Any]) -> str:
    notes = []
    for field, what in (("images_omitted", "{} of this segment {} not in this file"),
                        ("thumbnails_omitted", "{} of this segment {} no thumbnail in this file")):
        value = record.get(field)
        if value:
            one = value == 1
            verb = ("is" if one else "are") if field == "images_omitted" else ("has" if one else "have")
            notes.append(what.format(f"{_e(value)} image{'' if one else 's'}", verb))
    return f'<p class="left-out muted">{"; ".join(notes)} (the record keeps the first ones).</p>' if notes else ""


def detail_html(index: int, segments: Sequence[Mapping[str, Any]], summary: Mapping[str, Any], tokenizer: Any) -> str:
    """One trajectory's section of the page (hidden until its list row is chosen)."""
    last = segments[-1]
    images = _Images(segments)
    facts = [("step", summary["step"]), ("group", summary["group"]), ("sample", summary["sample"]),
             ("reward", fmt_reward(summary["reward"], ".4g")), ("failed", summary["failed"]),
             ("data source", last.get("data_source")), ("ground truth", last.get("ground_truth")),
             ("advantage", last.get("advantage")), ("segments", summary["segments"]),
             ("tool calls", summary["tools"]), ("tokens", f"{summary['length']} ({summary['generated']} generated)"),
             ("images", len(images.shown) or None)]
    fact_html = "".join(f'<span class="fact"><b>{_e(k)}</b> {_e(v)}</span>' for k, v in facts if v is not None)
    verdict_cls = "bad" if summary["verdict"] == "mismatch" else "good"
    parts = [f'<section class="detail" id="traj-{index}" data-index="{index}" hidden>',
             f'<h2>Trajectory {index}</h2><div class="facts">{fact_html}<span class="fact verdict {verdict_cls}">'
             f'<b>sanity check</b> {_e(summary["verdict"])}</span></div>']
    error = (last.get("metrics") or {}).get("error")
    if error:
        parts.append(f'<pre class="error">{_e(error)}</pre>')
    parts.append("<h3>Messages</h3>" + _messages_html(last.get("messages"), images) + _unplaced_html(images))
    for seg, numbers in zip(segments, images.per_segment, strict=True):
        k = seg.get("segment_index") or 0
        parts.append(f'<div class="segment" data-segment="{as_int(k)}"><h3>Segment {_e(k)}: tokens</h3>'
                     + _left_out_html(seg) + _mismatch_html(seg, tokenizer) + _tokens_html(seg, tokenizer, numbers)
                     + "<details><summary>metrics</summary>" + _metrics_html(seg) + "</details></div>")
    parts.append("</section>")
    return "".join(parts)
