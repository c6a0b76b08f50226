"""Framed deltas: what tool results add after an assistant turn, without rendering the history.

A delta rendered over the whole history (``delta_strategy="history"``, and ``auto`` with a
sanity check) costs a template render of every earlier turn, and a tool loop appends one after
every turn: at 4096 concurrent trajectories that render was a third of the framework's time
(``bench/bench_scale.py``). For most templates the text a tool message adds after an assistant
turn is fixed framing around the message's content (ChatML: the rest of the turn's close, then
``<|im_start|>user\\n<tool_response>\\n`` + content + ``\\n</tool_response><|im_end|>\\n`` and the
generation prompt), the same at every turn of every conversation. A frame is that framing,
found once per template and *shape* of the new messages (how many tool messages, each one's
``name``, which fields it has, whether the engine ended the turn on a stop token): the delta is
rendered with a sentinel in place of each content (and ``tool_call_id``), and the text between
the sentinels is kept. Afterwards a delta of that shape is the frame filled with the contents,
with the same content marks the renderer gives them (:mod:`.content_marks`).

Exact per template, or not used:

* **At the frame's build** the template must render each sentinel exactly once and verbatim
  (not escaped, trimmed or moved), and give the same frame after two other histories (one
  with no earlier turn, one with more turns and tool results than the new messages before
  the last assistant turn: a template that numbers tool results, or frames one by its
  position or by the messages before the last turn, differs from one of them whatever the
  real history holds). Then the frame filled with each of :data:`PROBE_CONTENTS` (leading and
  trailing spaces and newlines, empty, JSON with quotes and backslashes, the template's own
  tags and special tokens as text, Unicode) must equal the full render of the delta with that
  content, after each of the three histories. Any difference, or a template that refuses a probe, leaves that shape on
  the full render.
* **At run time** the first :data:`VERIFY_USES` uses of each frame, then one use in
  :data:`AUDIT_EVERY`, also render the delta in full; the first difference turns frames off
  for the template for good (a log line says why) and that delta is the full render.

A trajectory keeps a framed delta as the history render of its inputs, so its engine-view
sanity check (which reuses the renders a trajectory made) takes it on the strength of these
checks; where a message changed since, the check renders that delta again, unframed.

A frame gives text, not ids: the text is encoded as every delta is, so a token merge across the
frame's edges (a content starting with a space after ``\\n``) encodes as it does in the full
render. Templates that render a tool result only after the call it answers (gpt-oss, Mistral)
read the assistant turn's calls, which differ at every turn: they never use frames. So does
``delta_strategy="history"``, the setting that asks for the render of the whole history.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger(__name__)

__all__ = ["AUDIT_EVERY", "MAX_SHAPES", "PROBE_CONTENTS", "VERIFY_USES", "DeltaFrame", "TemplateFrames",
           "template_frames"]

VERIFY_USES = 3
"""Uses of each frame also rendered in full (and equal) before the frame is trusted alone."""
AUDIT_EVERY = 64
"""After that, one use in this many is still rendered in full and compared."""
MAX_SHAPES = 64
"""Shapes of new messages given a frame per template (more tool names than this render in full)."""

PROBE_CONTENTS: tuple[str, ...] = (
    "4",
    " leading space",
    "trailing space ",
    "\nnewlines around\n",
    "",
    "\t  \n",
    "line one\n\nline two\r\n",
    '{"result": "4", "quote": "\\"", "path": "C:\\\\x"}',
    "</tool_response>\n<tool_response>",
    "{{ messages }} {% if x %}",
    "e\u0301 \u4e2d\u6587 \U0001f642",
)
"""Contents each frame is checked with against the full render; the template's special tokens
(as text) are added per template."""

_FIELDS = frozenset({"role", "content", "name", "tool_call_id"})
_SLOT_FIELDS = ("content", "tool_call_id")


def _sentinel(index: int, name: str) -> str:
    # ASCII: a template that JSON-encodes the value still writes it, and the probes reject it.
    return f"agentloop-slot-{index}-{name}-7d1f"


@dataclass(frozen=True)
class DeltaFrame:
    """The fixed text of one shape's delta, around its slots."""

    parts: tuple[str, ...]
    """The text before the first slot, between slots, and after the last (one more than slots)."""
    slots: tuple[tuple[int, str], ...]
    """Which value fills each slot: (index of the new message, field)."""

    def fill(self, messages: Sequence[Mapping[str, Any]], mark: Callable[[str], str]) -> str:
        """The delta text for ``messages``: each slot's value marked as the renderer marks content."""
        out = [self.parts[0]]
        for (index, name), part in zip(self.slots, self.parts[1:], strict=True):
            out.append(mark(messages[index][name]))
            out.append(part)
        return "".join(out)


def shape_of(new_messages: Sequence[Mapping[str, Any]], ended: bool) -> tuple | None:
    """The key of the frame for ``new_messages``, or None when they cannot be framed: only tool
    messages with text content and no fields beyond ``role``, ``content``, ``name`` and
    ``tool_call_id`` (text) are."""
    shape = []
    for m in new_messages:
        if (m.get("role") != "tool" or not isinstance(m.get("content"), str) or not _FIELDS.issuperset(m)
                or not isinstance(m.get("tool_call_id", ""), str) or not isinstance(m.get("name", ""), str)):
            return None
        shape.append((m.get("name"), "name" in m, "tool_call_id" in m))
    return (ended, tuple(shape))


@dataclass
class TemplateFrames:
    """The frames of one template (and its tools, variables and special tokens), shared by
    every renderer of it."""

    frames: dict[tuple, DeltaFrame | None] = field(default_factory=dict)
    """Per shape: its frame, or None where the template does not frame it."""
    uses: dict[tuple, int] = field(default_factory=dict)
    """Per shape: how many deltas its frame gave."""
    off: str = ""
    """Why frames are off for this template ("" while on)."""
    lock: threading.Lock = field(default_factory=threading.Lock)

    def text(self, history: Sequence[Mapping[str, Any]], new_messages: Sequence[Mapping[str, Any]], ended: bool,
             *, render: Callable[[Sequence[Mapping[str, Any]], Sequence[Mapping[str, Any]]], str],
             mark: Callable[[str], str], probes: Sequence[str] = ()) -> str | None:
        """The delta text of ``new_messages`` after ``history`` from this shape's frame; None
        where there is no frame (the caller renders it in full).

        Args:
            history: The conversation so far, ending with the assistant turn.
            new_messages: The messages to add.
            ended: Whether the engine ended the last turn on a stop token.
            render: The full render of a delta: ``render(history, new_messages)``.
            mark: The renderer's marking of a content string.
            probes: More probe contents (the template's special tokens as text).
        """
        if self.off:
            return None
        shape = shape_of(new_messages, ended)
        if shape is None:
            return None
        frame = self.frames.get(shape, _MISSING)
        if frame is _MISSING:
            if len(self.frames) >= MAX_SHAPES:
                return None
            frame = _build(history, new_messages, render, mark, (*PROBE_CONTENTS, *probes))
            with self.lock:
                self.frames[shape] = frame
        if frame is None:
            return None
        assert isinstance(frame, DeltaFrame)
        text = frame.fill(new_messages, mark)
        with self.lock:
            uses = self.uses[shape] = self.uses.get(shape, 0) + 1
        if uses <= VERIFY_USES or uses % AUDIT_EVERY == 0:
            full = render(history, new_messages)
            if full != text:
                self.off = (f"a framed delta of {len(new_messages)} tool message(s) differed from the full render "
                            f"(use {uses}): framed {text[:200]!r}, rendered {full[:200]!r}")
                logger.warning("the chat template frames tool results differently in some conversation; every "
                               "delta of it renders the whole history from now on: %s", self.off)
                return full
        return text


_MISSING: Any = object()


def _build(history: Sequence[Mapping[str, Any]], new_messages: Sequence[Mapping[str, Any]],
           render: Callable[[Sequence[Mapping[str, Any]], Sequence[Mapping[str, Any]]], str],
           mark: Callable[[str], str], probes: Sequence[str]) -> DeltaFrame | None:
    """The frame of ``new_messages``' shape, checked as the module doc says; None where the
    template does not frame it."""
    sentinels = [{**m, **{name: _sentinel(i, name) for name in _SLOT_FIELDS if name in m}}
                 for i, m in enumerate(new_messages)]
    # Two other histories, with no earlier turn and with more earlier tool results than the new
    # messages: whatever the given history holds, one of them differs from it in both counts.
    earlier = [{**m, "content": "Earlier result."} for m in new_messages]
    histories = (history, [{"role": "user", "content": "Hello."}, history[-1]],
                 [{"role": "user", "content": "Hello."}, {"role": "assistant", "content": "Hello."}, *earlier,
                  {"role": "assistant", "content": "Hello."}, *earlier, history[-1]])
    try:
        text = render(history, sentinels)
        if any(render(other, sentinels) != text for other in histories[1:]):
            return None
        frame = _split(text, sentinels)
        if frame is None:
            return None
        for k, content in enumerate(probes):
            probe = [{**m, "content": probes[(k + i) % len(probes)] if i else content,
                      **({"tool_call_id": f"call_probe_{k}_{i}"} if "tool_call_id" in m else {})}
                     for i, m in enumerate(new_messages)]
            if render(histories[k % len(histories)], probe) != frame.fill(probe, mark):
                return None
    except Exception:  # a template that refuses a probe: that shape renders in full, as before
        logger.debug("no frame for tool messages %s", [m.get("name") for m in new_messages], exc_info=True)
        return None
    return frame


def _split(text: str, sentinels: Sequence[Mapping[str, Any]]) -> DeltaFrame | None:
    """``text`` cut at each sentinel it holds; None when a content's sentinel is not there once,
    or a ``tool_call_id``'s more than once."""
    found: list[tuple[int, int, str]] = []
    for i, m in enumerate(sentinels):
        for name in _SLOT_FIELDS:
            if name not in m:
                continue
            count = text.count(m[name])
            if count > 1 or (count == 0 and name == "content"):
                return None
            if count:
                found.append((text.index(m[name]), i, name))
    found.sort()
    parts, at = [], 0
    for start, i, name in found:
        parts.append(text[at:start])
        at = start + len(sentinels[i][name])
    parts.append(text[at:])
    return DeltaFrame(tuple(parts), tuple((i, name) for _, i, name in found))


# Per template key (ChatRenderer's: template, tools, variables, bos/eos, content marks): frames
# are a fact of the template, so every renderer of it shares them, as the delta verdicts are.
_TEMPLATES: dict[tuple, TemplateFrames] = {}


def template_frames(key: tuple) -> TemplateFrames:
    """The shared frames of the template with renderer key ``key``."""
    frames = _TEMPLATES.get(key)
    if frames is None:
        frames = _TEMPLATES.setdefault(key, TemplateFrames())
    return frames
