"""What one chat or completion request may make the server render and tokenize.

A chat template is code: whoever chooses the template text, or the variables it branches on,
chooses what the server computes (a nested ``range`` in Jinja freezes it for hours). So the
template is the operator's alone (``Gateway(chat_template=...)`` or the tokenizer's own), a
request may set only the template variables on the operator's allow-list, each to a short JSON
scalar, and the size of what gets rendered and tokenized is bounded before any work starts.

No HTTP here: the gateway calls :meth:`PromptLimits.check_chat_body` on every chat request
(wherever ``/v1`` is served), and the HTTP apps serve :class:`PromptLimitError` as 413.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["DEFAULT_TEMPLATE_VARIABLES", "MAX_TEMPLATE_VALUE_CHARS", "PromptLimitError", "PromptLimits"]

DEFAULT_TEMPLATE_VARIABLES = ("enable_thinking", "reasoning_effort", "thinking")
"""Template variables a request may set by default: the switches models document for callers
(Qwen3's ``enable_thinking``, gpt-oss's ``reasoning_effort``, ``thinking`` of several others)."""

MAX_TEMPLATE_VALUE_CHARS = 256
"""Longest string a request may pass as a template variable: switches, not payloads."""

_SET_BY_SERVER = frozenset({"messages", "conversation", "tools", "documents", "add_generation_prompt", "tokenize",
                            "chat_template", "continue_final_message", "return_dict", "tokenizer_kwargs",
                            "return_assistant_tokens_mask", "padding", "truncation", "max_length"})
"""``apply_chat_template`` arguments (not template variables): never on the allow-list."""

_CONFIGURE_TEMPLATE = ("a request cannot supply chat template text; configure the template on the server "
                       "(Gateway(chat_template=...), or the tokenizer's own chat_template)")


class PromptLimitError(ValueError):
    """A request over one of the :class:`PromptLimits` (the HTTP servers answer 413)."""


@dataclass(frozen=True)
class PromptLimits:
    """Bounds on what one request may make the server render and tokenize.

    Every limit is checked before the work it bounds (messages and characters before the
    template runs, tokens before the engine sees them), and a refusal names the limit and how
    to raise it.
    """

    max_messages: int = 2048
    """Most messages in one chat request (an agent's whole context, with room to spare)."""
    max_prompt_chars: int = 1_000_000
    """Most characters of text in one request's messages, tools and template variables (or a
    completion's text prompt): about 250k tokens, which bounds the render and tokenizer time."""
    max_prompt_tokens: int = 262_144
    """Most prompt tokens after rendering (the engine's ``max_model_len`` may refuse sooner)."""
    template_variables: tuple[str, ...] = DEFAULT_TEMPLATE_VARIABLES
    """Names a request's ``chat_template_kwargs`` may set (each to a JSON scalar); the server's
    own ``chat_template_kwargs`` are not limited by it."""

    def __post_init__(self) -> None:
        for name in ("max_messages", "max_prompt_chars", "max_prompt_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"PromptLimits.{name} must be a positive integer, got {value!r}")
        object.__setattr__(self, "template_variables", tuple(self.template_variables))
        reserved = sorted(set(self.template_variables) & _SET_BY_SERVER)
        if reserved:
            raise ValueError(f"PromptLimits.template_variables lists {reserved}, which are apply_chat_template "
                             "arguments, not template variables; a request must never set them")

    def check_chat_body(self, body: Any) -> None:
        """Check a raw chat completions body: no template text, only allowed template variables,
        and messages and characters within the limits (the shape is checked elsewhere).

        Raises:
            ValueError: for template text or a template variable that is not allowed (400).
            PromptLimitError: over ``max_messages`` or ``max_prompt_chars`` (413).
        """
        if not isinstance(body, Mapping):
            return  # the endpoint's own parser names the shape error
        if "chat_template" in body:
            raise ValueError(f"'chat_template' in the request: {_CONFIGURE_TEMPLATE}")
        self.check_template_kwargs(body.get("chat_template_kwargs"))
        messages = body.get("messages")
        if isinstance(messages, list) and len(messages) > self.max_messages:
            raise PromptLimitError(f"the request has {len(messages)} messages; the limit is {self.max_messages} "
                                   "(max_messages: raise it with PromptLimits(max_messages=...) on the server)")
        self.check_chars(count_chars((messages, body.get("tools"), body.get("chat_template_kwargs"))))

    def check_template_kwargs(self, kwargs: Any) -> None:
        """Check a request's ``chat_template_kwargs``: allow-listed names, short JSON scalars.

        Raises:
            ValueError: naming the variable, the allow-list and how the operator widens it.
        """
        if kwargs is None:
            return
        if not isinstance(kwargs, Mapping):
            raise ValueError(f"'chat_template_kwargs' must be an object, got {type(kwargs).__name__}")
        if "chat_template" in kwargs:
            raise ValueError(f"'chat_template_kwargs.chat_template': {_CONFIGURE_TEMPLATE}")
        for name, value in kwargs.items():
            if name not in self.template_variables:
                raise ValueError(
                    f"chat_template_kwargs may not set {str(name)[:64]!r}: a request may set only the template "
                    f"variables on the server's allow-list {list(self.template_variables)} (the operator adds "
                    "names with PromptLimits(template_variables=...) or `agentloop serve --template-variable`)")
            if value is not None and not isinstance(value, (bool, int, float, str)):
                raise ValueError(f"chat_template_kwargs[{name!r}] must be a JSON scalar (true/false, a number, "
                                 f"a short string or null), got {type(value).__name__}")
            if isinstance(value, str) and len(value) > MAX_TEMPLATE_VALUE_CHARS:
                raise ValueError(f"chat_template_kwargs[{name!r}] is {len(value)} characters; template variables "
                                 f"are switches of at most {MAX_TEMPLATE_VALUE_CHARS}")

    def check_chars(self, chars: int) -> None:
        """Raises :class:`PromptLimitError` when ``chars`` is over ``max_prompt_chars``."""
        if chars > self.max_prompt_chars:
            raise PromptLimitError(f"the request holds {chars} characters of prompt text; the limit is "
                                   f"{self.max_prompt_chars} (max_prompt_chars: raise it with "
                                   "PromptLimits(max_prompt_chars=...) on the server)")

    def check_tokens(self, tokens: int) -> None:
        """Raises :class:`PromptLimitError` when a prompt of ``tokens`` ids is over ``max_prompt_tokens``."""
        if tokens > self.max_prompt_tokens:
            raise PromptLimitError(f"the prompt has {tokens} tokens; the limit is {self.max_prompt_tokens} "
                                   "(max_prompt_tokens: raise it with PromptLimits(max_prompt_tokens=...) on the "
                                   "server)")


def count_chars(value: Any) -> int:
    """Characters in every string (keys included) of a decoded JSON value."""
    total, stack = 0, [value]
    while stack:  # iterative: a request's nesting depth is the client's choice
        item = stack.pop()
        if isinstance(item, str):
            total += len(item)
        elif isinstance(item, Mapping):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
    return total
