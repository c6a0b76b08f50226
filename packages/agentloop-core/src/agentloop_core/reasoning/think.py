"""``<think>...</think>`` reasoning: ``qwen3`` (Qwen3, QwQ) and ``deepseek_r1``.

The two differ in where a turn begins. ``qwen3`` begins in content unless the prompt opened a
``<think>`` it did not close (QwQ's and Qwen3-Thinking-2507's templates do; Qwen3's
``enable_thinking=False`` writes an empty, closed block). ``deepseek_r1`` always begins in
reasoning: R1 often writes no opening tag, so everything up to the first ``</think>`` is
reasoning, and a turn without one is all reasoning.
"""

from __future__ import annotations

from typing import ClassVar

from agentloop_core.reasoning.base import ReasoningParser, ReasoningSplit
from agentloop_core.reasoning.registry import register_reasoning_parser

OPEN = "<think>"
CLOSE = "</think>"


class ThinkReasoningParser(ReasoningParser):
    """Reasoning between :attr:`open_tag` and :attr:`close_tag`, any number of blocks per turn.

    A ``</think>`` with no ``<think>`` before it closes reasoning the turn began in (the
    template opened it, whether or not the loop was told), so the text before it is reasoning.
    An opening tag never closed makes the rest of the turn reasoning.
    """

    open_tag: ClassVar[str] = OPEN
    close_tag: ClassVar[str] = CLOSE
    always_starts_in_reasoning: ClassVar[bool] = False
    """The model's turns begin inside reasoning whatever the prompt says (DeepSeek-R1)."""
    reads_prompt = True

    @property
    def delimiters(self) -> tuple[str, ...]:
        return (self.open_tag, self.close_tag)

    def starts_in_reasoning(self, prompt_tail: str) -> bool:
        if self.always_starts_in_reasoning:
            return True
        opened = prompt_tail.rfind(self.open_tag)
        return opened >= 0 and prompt_tail.find(self.close_tag, opened) < 0

    def split(self, text: str, *, in_reasoning: bool = False) -> ReasoningSplit:
        inside = in_reasoning or self.always_starts_in_reasoning
        if not inside:
            first_close = text.find(self.close_tag)
            first_open = text.find(self.open_tag)
            inside = first_close >= 0 and (first_open < 0 or first_close < first_open)
        reasoning: list[str] = []
        content: list[str] = []
        pos = 0
        closed = True
        while True:
            if inside:
                end = text.find(self.close_tag, pos)
                if end < 0:
                    reasoning.append(text[pos:])
                    closed = False
                    break
                reasoning.append(text[pos:end])
                pos = end + len(self.close_tag)
            else:
                start = text.find(self.open_tag, pos)
                if start < 0:
                    content.append(text[pos:])
                    break
                content.append(text[pos:start])
                pos = start + len(self.open_tag)
            inside = not inside
        # R1 sometimes writes the opening tag after all; it is a delimiter, not reasoning.
        thought = "\n".join(r.replace(self.open_tag, "").strip() for r in reasoning)
        return ReasoningSplit(reasoning=thought.strip(), content="".join(content), closed=closed)


@register_reasoning_parser("qwen3", aliases=("qwq",))
class Qwen3ReasoningParser(ThinkReasoningParser):
    """Qwen3 / QwQ: content first, unless the prompt left a ``<think>`` open."""


@register_reasoning_parser("deepseek_r1")
class DeepSeekR1ReasoningParser(ThinkReasoningParser):
    """DeepSeek-R1: reasoning first, up to ``</think>``; no ``</think>``: all reasoning."""

    always_starts_in_reasoning = True


__all__ = ["DeepSeekR1ReasoningParser", "Qwen3ReasoningParser", "ThinkReasoningParser"]
