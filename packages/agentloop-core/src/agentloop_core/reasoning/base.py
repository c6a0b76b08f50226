"""Reasoning parsers: split one assistant turn's decoded text into reasoning and content.

A reasoning model thinks before it answers (Qwen3's ``<think>...</think>``, gpt-oss's
``analysis`` channel). A tool call the model drafts while thinking is not a call it made, so
the tool loops give the tool parser only the content. The split decides what is executed and
what is counted; it never changes the tokens: the trajectory keeps exactly what the engine
generated.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import ClassVar


@dataclass(frozen=True)
class ReasoningSplit:
    """One turn's text, split."""

    reasoning: str
    """The reasoning text, its delimiters removed, stripped; ``""`` when the turn has none."""
    content: str
    """The rest of the turn, as written (tool-call markup kept), for the tool parser."""
    closed: bool = True
    """False when the turn ended inside its reasoning (an unclosed ``<think>``): all of what
    followed the opening is reasoning."""

    @property
    def has_reasoning(self) -> bool:
        """True when the turn held any reasoning text."""
        return bool(self.reasoning)


class ReasoningParser(abc.ABC):
    """Splits the decoded text of one assistant turn into reasoning and content.

    Subclasses set :attr:`needs_special_tokens` where their delimiters are special tokens and
    implement :meth:`split`; :meth:`starts_in_reasoning` tells them when the prompt already
    opened the reasoning. They register under a name
    (:func:`~agentloop_core.reasoning.register_reasoning_parser`, or an entry point in the
    ``agentloop.reasoning_parsers`` group), which sets :attr:`name`; a streaming gateway reads
    :attr:`delimiters`.
    """

    name: ClassVar[str] = ""
    needs_special_tokens: ClassVar[bool] = False
    """True when the delimiters are special tokens that ``skip_special_tokens=True`` erases
    (harmony's ``<|channel|>``); such a parser pairs with a tool parser that needs them too."""
    reads_prompt: ClassVar[bool] = False
    """True when :meth:`starts_in_reasoning` looks at the prompt; the loop then decodes the
    prompt's last tokens (:data:`PROMPT_TAIL_TOKENS`) before each split."""

    @property
    def delimiters(self) -> tuple[str, ...]:
        """Text that opens or closes reasoning (``<think>``, ``</think>``). A streaming gateway
        holds back the end of the text that may still become one, so no piece of a delimiter
        is sent as reasoning or content. Empty (the default): nothing held back."""
        return ()

    def starts_in_reasoning(self, prompt_tail: str) -> bool:
        """Whether a turn generated after ``prompt_tail`` (the decoded end of the prompt,
        special tokens kept) begins inside reasoning, because the template opened it."""
        del prompt_tail
        return False

    def visible_content(self, content: str) -> str:
        """:attr:`ReasoningSplit.content` as a reader sees it (the gateway's ``content``): its
        delimiters removed, stripped. Tool-call markup stays; the tool parser removes it."""
        return content.strip()

    @abc.abstractmethod
    def split(self, text: str, *, in_reasoning: bool = False) -> ReasoningSplit:
        """Split ``text``, decoded as the tool parser reads it.

        Args:
            text: The turn's decoded text.
            in_reasoning: The turn begins inside reasoning (:meth:`starts_in_reasoning`).
        """


PROMPT_TAIL_TOKENS = 32
"""How many trailing prompt tokens a loop decodes for :meth:`ReasoningParser.starts_in_reasoning`
(enough for Qwen3's ``<think>\\n\\n</think>\\n\\n`` in any tokenizer)."""


__all__ = ["PROMPT_TAIL_TOKENS", "ReasoningParser", "ReasoningSplit"]
