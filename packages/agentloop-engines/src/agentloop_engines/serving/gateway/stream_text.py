"""What of a generation still being decoded may be sent to a streaming client already.

Text once sent cannot be taken back, so :class:`StreamText` sends only what the finished answer
will still hold:

* nothing of a character still incomplete (a multi-byte character split across tokens decodes
  to ``U+FFFD`` until its last byte arrives);
* nothing from a stop string on, and not the longest end of the text that may yet become one;
* not the end of the text that may yet become a reasoning delimiter or a tool-call opening
  (what the parsers declare: ``ReasoningParser.delimiters``, ``ToolParser.call_openings``);
* reasoning as ``reasoning_content`` while inside a reasoning block, content after it;
* with a tool parser, content only before the first tool-call opening, and each call once its
  block has closed (the same parse the whole answer gets, so the same name, arguments and id);
  a parser that declares no opening (or reads special tokens) has its answer sent whole at the
  end, which is always correct, only not incremental.

What is held back is sent when the generation ends (:meth:`StreamText.finish`), where the
finished answer (the one a non-streamed request gets) decides. No I/O here: the gateway feeds
it ids and sends what it returns.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from agentloop_core.parsers import ToolParser
from agentloop_core.reasoning import ReasoningParser

logger = logging.getLogger(__name__)

__all__ = ["StreamText", "held_suffix"]


def held_suffix(text: str, markers: Sequence[str]) -> int:
    """Length of the longest end of ``text`` that is the start (not the whole) of a marker."""
    longest = 0
    for marker in markers:
        for n in range(min(len(marker) - 1, len(text)), longest, -1):
            if text.endswith(marker[:n]):
                longest = n
                break
    return longest


class StreamText:
    """The deltas of one streamed chat or text completion.

    Args:
        decode: Ids to the response text (special tokens skipped), as the gateway decodes.
        stops: The request's stop strings.
        reasoning: The gateway's reasoning parser (chat only), or None.
        in_reasoning: The generation starts inside reasoning (the prompt opened it).
        parser: The tool parser when the request's tool calls are parsed, else None.
        tools: The request's tools by name (for the parser).
        format_calls: The gateway's formatting of parsed calls into OpenAI ``tool_calls``.
    """

    def __init__(self, decode: Callable[[Sequence[int]], str], stops: Sequence[str], *,
                 reasoning: ReasoningParser | None = None, in_reasoning: bool = False,
                 parser: ToolParser | None = None, tools: Mapping[str, Any] | None = None,
                 format_calls: Callable[[Any], list[dict[str, Any]]] | None = None) -> None:
        self.decode = decode
        self.stops = list(stops)
        self.reasoning = reasoning if reasoning is not None and not reasoning.needs_special_tokens else None
        self.in_reasoning = in_reasoning
        self.parser = parser
        self.tools = tools
        self.format_calls = format_calls
        # The parser says where its calls start (ToolParser.call_openings); one that does not, or
        # that reads special tokens this decode skips, leaves nothing to stream incrementally.
        self.openings: tuple[str, ...] = (
            tuple(parser.call_openings) if parser is not None and not parser.needs_special_tokens else ())
        # Nothing incremental where the whole answer's split cannot be foreseen from its start.
        self.whole = (reasoning is not None and self.reasoning is None) or (parser is not None and not self.openings)
        delimiters = self.reasoning.delimiters if self.reasoning is not None else ()
        self.markers = [m for m in (*self.stops, *delimiters, *self.openings) if m]
        self.ids: list[int] = []
        self.sent_content = ""
        self.sent_reasoning = ""
        self.sent_calls: list[dict[str, Any]] = []
        self.stopped = False

    def feed(self, ids: Sequence[int]) -> list[dict[str, Any]]:
        """Add newly generated ids; return the deltas (``{"content": ...}``,
        ``{"reasoning_content": ...}``, ``{"tool_calls": [...]}``) that may be sent now."""
        self.ids.extend(ids)
        if self.whole or self.stopped or not ids:
            return []
        text = self.decode(self.ids).rstrip("\ufffd")
        cut = _first_stop(text, self.stops)
        if cut is not None:
            text, self.stopped = text[:cut], True
        else:
            text = text[: len(text) - held_suffix(text, self.markers)]
        reasoning, content = "", text
        if self.reasoning is not None:
            split = self.reasoning.split(text, in_reasoning=self.in_reasoning)
            reasoning, content = split.reasoning, split.content
        deltas: list[dict[str, Any]] = []
        if reasoning.startswith(self.sent_reasoning) and len(reasoning) > len(self.sent_reasoning):
            deltas.append({"reasoning_content": reasoning[len(self.sent_reasoning):]})
            self.sent_reasoning = reasoning
        visible = content
        calls: list[dict[str, Any]] = []
        if self.openings:
            at = min((i for o in self.openings if (i := content.find(o)) >= 0), default=-1)
            if at >= 0:
                visible = content[:at]
                assert self.parser is not None
                assert self.format_calls is not None
                calls = self.format_calls(self.parser.parse(content[at:], self.tools, record=False))
            # Whitespace before a call is not content: held until text follows it.
            visible = visible.rstrip()
        if self.reasoning is not None:
            visible = self.reasoning.visible_content(visible)
        if visible.startswith(self.sent_content) and len(visible) > len(self.sent_content):
            deltas.append({"content": visible[len(self.sent_content):]})
            self.sent_content = visible
        for call in calls[len(self.sent_calls):]:
            deltas.append({"tool_calls": [{"index": len(self.sent_calls), **call}]})
            self.sent_calls.append(call)
        return deltas

    def finish(self, message: Mapping[str, Any]) -> list[dict[str, Any]]:
        """The deltas that complete the stream into the finished ``message`` (what a request
        without ``stream`` gets): the held-back text and the calls not sent yet."""
        deltas: list[dict[str, Any]] = []
        for key, sent in (("reasoning_content", self.sent_reasoning), ("content", self.sent_content)):
            final = message.get(key) or ""
            if not final.startswith(sent):
                logger.warning("streamed %s %r is not the start of the finished answer's %r; the client's "
                               "assembled message differs from a non-streamed one", key, sent[:80], final[:80])
            elif len(final) > len(sent):
                deltas.append({key: final[len(sent):]})
        calls = list(message.get("tool_calls") or ())
        if calls[: len(self.sent_calls)] != self.sent_calls:
            logger.warning("streamed tool calls %s are not the finished answer's first calls %s", self.sent_calls,
                           calls)
        for index in range(len(self.sent_calls), len(calls)):
            deltas.append({"tool_calls": [{"index": index, **calls[index]}]})
        return deltas


def _first_stop(text: str, stops: Sequence[str]) -> int | None:
    found = [pos for s in stops if (pos := text.find(s)) >= 0]
    return min(found) if found else None
