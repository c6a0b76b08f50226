"""What one chat or completion request may make the server render and tokenize.

A chat template is code: whoever chooses the template text, or the variables it branches on,
chooses what the server computes (a nested ``range`` in Jinja freezes it for hours). So the
template is the operator's alone (``Gateway(chat_template=...)`` or the tokenizer's own), a
request may set only the template variables on the operator's allow-list, each to a short JSON
scalar, and the size of what gets rendered and tokenized is bounded before any work starts.

What is counted is what the server computes with, not only the text: every list a request
carries has a bound of its own (messages, tools, a message's tool calls, stop strings), and
the characters counted are the JSON size of everything rendered or tokenized (messages with
their tool-call arguments' numbers, booleans, nulls and nesting, tools, template variables,
stop strings), so a request cannot make the server do work its counts do not see.

No HTTP here: the gateway calls :meth:`PromptLimits.check_chat_body` on every chat request
(wherever ``/v1`` is served), and the HTTP apps serve :class:`PromptLimitError` as 413.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from agentloop_engines.serving.gateway.images import sized_messages

__all__ = ["DEFAULT_TEMPLATE_VARIABLES", "MAX_TEMPLATE_VALUE_CHARS", "PromptLimitError", "PromptLimits",
           "context_length", "json_size"]

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
    """Most characters in what one request makes the server render and tokenize: the JSON size
    (quotes and escapes aside) of its messages (image URLs excepted: they are decoded, not
    rendered, within the gateway's image limits), tools, template variables and stop strings, or
    a completion's text prompt and stop strings; about 250k tokens, which bounds the render and
    tokenizer time."""
    max_prompt_tokens: int = 262_144
    """Most prompt tokens after rendering (the engine's ``max_model_len`` may refuse sooner)."""
    max_tools: int = 512
    """Most tools in one chat request's ``tools``."""
    max_tool_calls: int = 512
    """Most tool calls in one message's ``tool_calls``."""
    max_stop_strings: int = 64
    """Most text ``stop`` strings in one request (each is tokenized, and searched for in every
    prefix the stop search decodes)."""
    max_json_depth: int = 64
    """Deepest nesting of lists and objects in one request's messages, tools and template
    variables (tool-call arguments sent as a JSON string included, once decoded): deeper values
    would overflow the recursion of a JSON encoder or of the template's ``tojson``."""
    template_variables: tuple[str, ...] = DEFAULT_TEMPLATE_VARIABLES
    """Names a request's ``chat_template_kwargs`` may set (each to a JSON scalar); the server's
    own ``chat_template_kwargs`` are not limited by it."""

    def __post_init__(self) -> None:
        for name in _SIZES:
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
        and every count within the limits (the shape is checked elsewhere).

        Raises:
            ValueError: for template text or a template variable that is not allowed (400).
            PromptLimitError: over ``max_messages``, ``max_tools``, ``max_tool_calls``,
                ``max_stop_strings``, ``max_json_depth`` or ``max_prompt_chars`` (413).
        """
        if not isinstance(body, Mapping):
            return  # the endpoint's own parser names the shape error
        if "chat_template" in body:
            raise ValueError(f"'chat_template' in the request: {_CONFIGURE_TEMPLATE}")
        self.check_lists(body)
        self.check_template_kwargs(body.get("chat_template_kwargs"))
        # An image's URL is never rendered: its own limits bound it (gateway.images), not these.
        rendered = (sized_messages(body.get("messages")), body.get("tools"), body.get("chat_template_kwargs"),
                    body.get("stop"))
        self.check_chars(self.json_size(rendered))

    def check_completion_body(self, body: Any) -> None:
        """Check a raw completions body: the ``stop`` list, a token-id prompt's length, and the
        characters of a text prompt and its stop strings.

        Raises:
            PromptLimitError: over ``max_stop_strings``, ``max_prompt_tokens`` or
                ``max_prompt_chars`` (413).
        """
        if not isinstance(body, Mapping):
            return
        self.check_lists(body)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, list):  # token ids: counted before each id is looked at
            self.check_tokens(len(prompt))
            prompt = None
        self.check_chars(self.json_size((prompt, body.get("stop"))))

    def check_lists(self, body: Any) -> None:
        """Check the length of every list of a raw chat or completions body against its own
        limit: ``messages``, ``tools``, each message's ``tool_calls``, ``stop``. Cheap (no list
        is walked but the messages), so a server runs it before handing the body to a thread.

        Raises:
            PromptLimitError: naming the list, its length, the limit and how to raise it (413).
        """
        if not isinstance(body, Mapping):
            return
        messages = body.get("messages")
        _check_length("messages", messages, self.max_messages, "max_messages")
        _check_length("tools", body.get("tools"), self.max_tools, "max_tools")
        _check_length("stop", body.get("stop"), self.max_stop_strings, "max_stop_strings")
        if isinstance(messages, list):
            for i, message in enumerate(messages):
                if isinstance(message, Mapping):
                    _check_length(f"messages[{i}].tool_calls", message.get("tool_calls"), self.max_tool_calls,
                                  "max_tool_calls")

    def json_size(self, value: Any, depth: int = 0) -> int:
        """:func:`json_size` of ``value``, refusing nesting deeper than ``max_json_depth``.

        Args:
            value: A decoded JSON value.
            depth: How deep in the request ``value`` sits (its lists and objects count from there).

        Raises:
            PromptLimitError: over ``max_json_depth`` (413).
        """
        return json_size(value, self.max_json_depth, depth)

    def depth_error(self) -> PromptLimitError:
        """The refusal of a value nested deeper than ``max_json_depth`` (for a decoder that found it)."""
        return _too_deep(self.max_json_depth)

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


_SIZES = ("max_messages", "max_prompt_chars", "max_prompt_tokens", "max_tools", "max_tool_calls", "max_stop_strings",
          "max_json_depth")
_SCALAR_SIZE = {True: 4, False: 5}  # true, false (None is counted apart: null)


def _check_length(field: str, value: Any, limit: int, name: str) -> None:
    if isinstance(value, list) and len(value) > limit:
        raise PromptLimitError(f"the request's {field!r} has {len(value)} entries; the limit is {limit} ({name}: "
                               f"raise it with PromptLimits({name}=...) on the server)")


def _too_deep(limit: int) -> PromptLimitError:
    return PromptLimitError(f"the request nests lists and objects more than {limit} deep; the limit is {limit} "
                            "(max_json_depth: raise it with PromptLimits(max_json_depth=...) on the server)")


def json_size(value: Any, max_depth: int | None = None, depth: int = 0) -> int:
    """Characters of ``value``'s compact JSON text, quotes and escapes aside: each string's
    length (keys included), each number's digits, ``true``/``false``/``null``, and the brackets,
    commas and colons of every list and object. What a template writing the value out with
    ``tojson``, and the tokenizer after it, have to get through.

    Args:
        value: A decoded JSON value (tuples count as lists).
        max_depth: Deepest nesting of lists and objects allowed; None: any.
        depth: How deep ``value`` itself sits (its lists and objects count from there).

    Raises:
        PromptLimitError: nested deeper than ``max_depth``.
    """
    total, stack = 0, [(value, depth)]
    while stack:  # iterative: a request's nesting depth is the client's choice
        item, depth = stack.pop()
        if isinstance(item, str):
            total += len(item)
        elif isinstance(item, bool):
            total += _SCALAR_SIZE[item]
        elif item is None:
            total += 4
        elif isinstance(item, int):
            bits = item.bit_length()
            # Past ~3,000 digits from the bit length: str() of a huge int is slow (and refused past 4,300).
            total += len(str(item)) if bits <= 10_000 else 1 + (item < 0) + bits * 30103 // 100000
        elif isinstance(item, float):
            total += len(repr(item))
        elif isinstance(item, (Mapping, list, tuple)):
            depth += 1
            if max_depth is not None and depth > max_depth:
                raise _too_deep(max_depth)
            items = list(item.items()) if isinstance(item, Mapping) else item
            total += 2 + max(len(items) - 1, 0) + (len(items) if isinstance(item, Mapping) else 0)
            for entry in items:
                if isinstance(item, Mapping):
                    stack.append((entry[0], depth))
                    stack.append((entry[1], depth))
                else:
                    stack.append((entry, depth))
        else:
            total += len(str(item))
    return total


def context_length(server: Any) -> int | None:
    """The server's context length; for an ``LLMServerClient``, the smallest of its replicas'."""
    servers = getattr(server, "servers", None)
    targets = list(servers) if isinstance(servers, list) and servers else [server]
    lengths = []
    for target in targets:
        try:
            value = getattr(target, "max_model_len", None)
        except Exception:  # noqa: BLE001 - a remote server not reachable yet: use SamplingParams' default
            return None
        if not isinstance(value, int) or isinstance(value, bool):
            return None
        lengths.append(value)
    return min(lengths)
