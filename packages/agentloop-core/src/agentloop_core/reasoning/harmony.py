"""``gpt_oss`` reasoning: the harmony ``analysis`` channel.

A gpt-oss turn is a sequence of harmony messages (see :mod:`agentloop_core.parsers.harmony`).
The bodies of ``analysis`` messages are reasoning; the other messages (``final``,
``commentary``) and any loose text are content, kept as written so the ``gpt_oss`` tool parser
reads them. A message addressed to a tool (``to=functions.x`` or a built-in such as ``python``)
is a call whatever its channel: harmony marks calls in the header, and gpt-oss calls its
built-in tools from the analysis channel. Text in an analysis body never becomes a call.
"""

from __future__ import annotations

from agentloop_core.parsers import harmony
from agentloop_core.reasoning.base import ReasoningParser, ReasoningSplit
from agentloop_core.reasoning.registry import register_reasoning_parser


@register_reasoning_parser("gpt_oss", aliases=("harmony",))
class GptOssReasoningParser(ReasoningParser):
    """Splits harmony messages: unaddressed ``analysis`` bodies are reasoning."""

    needs_special_tokens = True

    def split(self, text: str, *, in_reasoning: bool = False) -> ReasoningSplit:
        del in_reasoning  # the generation prompt opens a header, never a body
        reasoning: list[str] = []
        content: list[str] = []
        closed = True
        for item in harmony.split_messages(text):
            if isinstance(item, str):
                content.append(item)
            elif harmony.message_channel(item.header) in harmony.HIDDEN_CHANNELS and \
                    harmony.message_recipient(item.header) is None:
                reasoning.append(harmony.SPECIAL.sub("", item.body).strip())
                closed = item.end is not None
            else:
                content.append(item.raw)
        return ReasoningSplit(reasoning="\n".join(r for r in reasoning if r), content="".join(content), closed=closed)

    def visible_content(self, content: str) -> str:
        """The bodies of the messages that address no tool, and loose text, joined by newlines
        (calls are left to the ``gpt_oss`` tool parser)."""
        parts: list[str] = []
        for item in harmony.split_messages(content):
            if isinstance(item, str):
                parts.append(harmony.SPECIAL.sub("", item).strip())
            elif harmony.message_recipient(item.header) is None:
                parts.append(harmony.SPECIAL.sub("", item.body).strip())
        return "\n".join(p for p in parts if p)


__all__ = ["GptOssReasoningParser"]
