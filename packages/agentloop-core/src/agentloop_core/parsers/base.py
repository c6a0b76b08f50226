"""Tool-call parser records and the base class every parser implements.

A parser turns the decoded text of one assistant turn into tool calls. It never raises: a call
it cannot use (bad JSON, unknown tool, arguments that break the tool's schema) becomes a
:class:`ToolCallError` whose ``reason`` is written for the model, so the loop can send it back
as a tool message and the model can fix its call on the next turn.
"""

from __future__ import annotations

import abc
import json
import logging
import threading
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from agentloop_core.parsers.schema_check import check_arguments

logger = logging.getLogger("agentloop_core.parsers")


@dataclass(frozen=True)
class ToolCall:
    """One well-formed call to a known tool, with arguments that passed the schema check."""

    id: str
    """Call id, unique within the turn (``call_0``, ``call_1``...); the loop may prefix it."""
    name: str
    """Tool name."""
    arguments: dict[str, Any]
    """Decoded arguments."""
    model_id: str | None = None
    """The id the model wrote for the call, for formats that carry one (Mistral's ``"id"``) and
    only when it is one the model's chat template accepts; the loop answers the call under it.
    None: the loop makes an id with :meth:`ToolParser.make_call_id`."""


@dataclass(frozen=True)
class ToolCallError:
    """A call the parser could not turn into a :class:`ToolCall`."""

    raw: str
    """The text of the broken call, as the model wrote it."""
    reason: str
    """What is wrong and how to fix it, written for the model."""
    kind: str = "invalid_json"
    """Category for counters: ``invalid_json``, ``unclosed_tag``, ``stray_tag``, ``nested_tag``,
    ``missing_name``, ``unknown_tool``, ``invalid_arguments``, ``trailing_text``, ``internal``."""
    name: str | None = None
    """Tool name, when the parser got that far."""


@dataclass(frozen=True)
class ParseResult:
    """What a parser found in one assistant turn."""

    content: str
    """The turn's text with the tool-call markup removed, stripped."""
    calls: list[ToolCall] = field(default_factory=list)
    """Usable calls, in the order they appear."""
    errors: list[ToolCallError] = field(default_factory=list)
    """Calls that could not be used, in the order they appear."""

    @property
    def attempted(self) -> bool:
        """True when the model tried to call at least one tool (well-formed or not)."""
        return bool(self.calls or self.errors)


def tool_function(spec: Any) -> dict[str, Any] | None:
    """The function dict (``name``, ``description``, ``parameters``...) of a tool spec, or None
    when it is not one.

    Accepts what loops hold: an ``OpenAIFunctionToolSchema`` (pydantic), a ``BaseTool`` (its
    ``tool_schema``), an OpenAI tool dict ``{"type": "function", "function": {...}}``, or a bare
    function dict ``{"name", "parameters"}``.
    """
    if spec is None:
        return None
    schema = getattr(spec, "tool_schema", None)
    if schema is not None:
        spec = schema
    if hasattr(spec, "model_dump"):
        spec = spec.model_dump(exclude_none=True)
    if not isinstance(spec, Mapping):
        return None
    function = spec.get("function", spec)
    if hasattr(function, "model_dump"):
        function = function.model_dump(exclude_none=True)
    return dict(function) if isinstance(function, Mapping) else None


def tool_parameters(spec: Any) -> dict[str, Any] | None:
    """The ``parameters`` JSON schema of a tool spec (any form :func:`tool_function` accepts),
    or None when it declares none."""
    function = tool_function(spec)
    parameters: Any = function.get("parameters") if function is not None else None
    if hasattr(parameters, "model_dump"):
        parameters = parameters.model_dump(exclude_none=True)
    return dict(parameters) if isinstance(parameters, Mapping) else None


def json_error(exc: BaseException) -> str:
    """A short, model-readable description of a JSON decoding failure."""
    if isinstance(exc, json.JSONDecodeError):
        return f"{exc.msg} at character {exc.pos}"
    return type(exc).__name__


class ParseStats:
    """Thread-safe counters of parse outcomes with one aggregated warning per ``log_every``
    failed calls, so a model that emits broken calls all batch long does not flood the log."""

    def __init__(self, log_every: int = 100) -> None:
        self.log_every = log_every
        self.turns = 0
        self.calls = 0
        self.errors: Counter[str] = Counter()
        self._since_log: Counter[str] = Counter()
        self._example: str | None = None
        self._lock = threading.Lock()

    def record(self, parser: str, result: ParseResult) -> None:
        with self._lock:
            self.turns += 1
            self.calls += len(result.calls)
            for error in result.errors:
                self.errors[error.kind] += 1
                self._since_log[error.kind] += 1
                if self._example is None or error.kind == "internal":
                    self._example = error.reason
            if sum(self._since_log.values()) >= self.log_every:
                self._emit(parser)

    def flush(self, parser: str = "tool parser") -> None:
        """Log the failures counted since the last summary, if any."""
        with self._lock:
            if self._since_log:
                self._emit(parser)

    def _emit(self, parser: str) -> None:
        kinds = ", ".join(f"{k}={v}" for k, v in self._since_log.most_common())
        logger.warning(
            "%s: %d malformed tool calls since the last summary (%s); totals: %d turns, %d calls, "
            "%d errors; example: %s",
            parser, sum(self._since_log.values()), kinds, self.turns, self.calls,
            sum(self.errors.values()), self._example,
        )
        self._since_log.clear()
        self._example = None

    def as_dict(self) -> dict[str, int]:
        with self._lock:
            return {"turns": self.turns, "calls": self.calls, **{f"errors/{k}": v for k, v in self.errors.items()}}


class ToolParser(abc.ABC):
    """Parses tool calls out of the decoded text of one assistant turn.

    Subclasses set :attr:`stop_tokens` (and :attr:`call_openings`, :attr:`needs_special_tokens`
    where they apply), implement :meth:`_parse`, and register under a name
    (:func:`~agentloop_core.parsers.register_tool_parser`, or an entry point in the
    ``agentloop.tool_parsers`` group), which sets :attr:`name`.
    """

    name: ClassVar[str] = ""
    stop_tokens: ClassVar[tuple[str, ...]] = ()
    """Token strings (besides the model's EOS) that end a tool-calling turn; the loop maps
    them to ids with the tokenizer and passes them as ``stop_token_ids``."""
    needs_special_tokens: ClassVar[bool] = False
    """True when the call markup is made of special tokens (harmony's ``<|channel|>`` and
    ``<|call|>``, Mistral's ``[TOOL_CALLS]``) that ``skip_special_tokens=True`` erases, leaving
    text no parser can split into calls. The loop then passes the turn decoded with special
    tokens kept; a trailing token that ended the turn is removed unless it is one of
    :attr:`stop_tokens` (harmony's ``<|call|>`` closes the call it ends)."""
    call_openings: ClassVar[tuple[str, ...]] = ()
    """Text that opens a call in the decoded turn (hermes: ``<tool_call>``), for a format where
    the text before the first opening is content and the calls follow it. A streaming gateway
    then sends that content as it is generated, holds back only what may still become an
    opening, and parses each call once its block closes. Empty (the default), or with
    :attr:`needs_special_tokens`: where the calls start cannot be told from the text so far
    (``llama3_json``: the whole turn is a call only if it starts with ``{``), so a streamed
    answer with tools is sent whole when the generation ends (correct, only not incremental)."""

    def __init__(self, stats: ParseStats | None = None) -> None:
        self.stats = stats if stats is not None else ParseStats()

    def make_call_id(self, turn: int, index: int, call: ToolCall | None = None) -> str:
        """The id a loop gives a call the model wrote no id for (``call.model_id`` is None): it
        goes on the tool message answering the call (``tool_call_id``) and on the call attached
        to the assistant turn, so it must be one the model's chat template accepts.

        Args:
            turn: The assistant turn the call is in (1 for the first generated turn).
            index: Position of the call in that turn's answers: usable calls first, then the
                calls the parser could not use (:attr:`ParseResult.errors`).
            call: The call, or None for one the parser could not use.

        Returns:
            ``call_<turn>_<call.id>`` (``call_2_call_0``), and ``""`` for an unusable call. Parsers
            whose template checks ids (Mistral: 9 letters or digits) override this.
        """
        return f"call_{turn}_{call.id}" if call is not None else ""

    def parse(self, text: str, tools: Mapping[str, Any] | None = None, *, record: bool = True) -> ParseResult:
        """Find the tool calls in ``text``.

        Args:
            text: Decoded text the engine generated for one turn: special tokens skipped, or
                kept when :attr:`needs_special_tokens` (see there).
            tools: Known tools by name (schemas, ``BaseTool`` objects or OpenAI tool dicts).
                A call to a name not in it is an error; None accepts any name unchecked.
            record: Count the outcome in :attr:`stats`. False for text the loop only inspects
                (a turn's reasoning, read for the calls it drafted), so the counters stay one
                per turn.

        Returns:
            Content, usable calls and errors. Never raises: an unexpected failure inside the
            parser is returned as an ``internal`` error and logged.
        """
        if not isinstance(text, str):
            result = ParseResult(content="", errors=[ToolCallError(
                repr(text)[:200], f"parser expected decoded text, got {type(text).__name__}", "internal")])
        else:
            try:
                result = self._parse(text, tools)
            except Exception as exc:  # the loop must survive any text the model writes
                logger.exception("%s parser failed on %r", self.name, text[:200])
                result = ParseResult(content=text.strip(), errors=[ToolCallError(
                    text[:200], f"internal parser error ({type(exc).__name__}: {exc})", "internal")])
        if record:
            self.stats.record(self.name or type(self).__name__, result)
        return result

    @abc.abstractmethod
    def _parse(self, text: str, tools: Mapping[str, Any] | None) -> ParseResult:
        """Parse one turn; may raise only on a parser bug (``parse`` turns that into an error)."""

    def build_call(
        self, raw: str, payload: Any, index: int, tools: Mapping[str, Any] | None, args_key: tuple[str, ...]
    ) -> ToolCall | ToolCallError:
        """Validate one decoded call object ``{"name": ..., <args_key>: {...}}``.

        Args:
            raw: The call's text, kept in errors.
            payload: The decoded JSON value.
            index: Position of the call in the turn (for its id).
            tools: Known tools by name, or None to skip name and argument checks.
            args_key: Keys that may hold the arguments, in order of preference.

        Returns:
            The call, or the error describing what is wrong with it.
        """
        if not isinstance(payload, dict):
            return ToolCallError(raw, "a tool call must be a JSON object with \"name\" and "
                                 f"\"{args_key[0]}\", got {type(payload).__name__}", "missing_name")
        name = payload.get("name")
        if not isinstance(name, str) or not name:
            return ToolCallError(raw, f"the tool call has no \"name\" string; write "
                                 f"{{\"name\": <tool name>, \"{args_key[0]}\": {{...}}}}", "missing_name")
        if not_text(name):
            return ToolCallError(raw, f"the tool call's name holds {_SURROGATE}", "missing_name")
        if tools is not None and name not in tools:
            known = ", ".join(sorted(tools)) or "(none)"
            return ToolCallError(raw, f"unknown tool {name!r}; available tools: {known}", "unknown_tool", name)
        arguments: Any = {}
        for key in args_key:
            if key in payload:
                arguments = payload[key]
                break
        if isinstance(arguments, str):
            # Some models emit the arguments object as a JSON string; accept it if it decodes.
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except ValueError:
                return ToolCallError(raw, f"the \"{args_key[0]}\" of {name!r} is a string that is not "
                                     "valid JSON; pass a JSON object", "invalid_arguments", name)
        if holds_non_text(arguments):
            return ToolCallError(raw, f"the arguments of {name!r} hold {_SURROGATE}", "invalid_arguments", name)
        parameters = tool_parameters(tools.get(name)) if tools is not None else None
        problems = check_arguments(arguments, parameters)
        if problems:
            return ToolCallError(raw, f"invalid arguments for {name!r}: " + "; ".join(problems),
                                 "invalid_arguments", name)
        return ToolCall(id=f"call_{index}", name=name, arguments=arguments)


_SURROGATE = ("a lone UTF-16 surrogate (a JSON escape such as \"\\ud800\" with no pair), which is not "
              "Unicode text: no tool, tokenizer or API answer can carry it; write the character itself or a "
              "pair of escapes")


def not_text(value: str) -> bool:
    """Whether ``value`` holds a lone UTF-16 surrogate (``json.loads`` makes one of an unpaired
    ``\\udXXX`` escape, which a policy can write): UTF-8 cannot encode it, so neither a tool,
    a tokenizer nor a JSON answer can take it."""
    if value.isascii():
        return False
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def holds_non_text(value: Any) -> bool:
    """Whether any string (or object key) in a decoded JSON value is :func:`not_text`."""
    stack = [value]
    while stack:  # a loop, not recursion: the nesting is the model's choice
        item = stack.pop()
        if isinstance(item, str):
            if not_text(item):
                return True
        elif isinstance(item, Mapping):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
    return False


__all__ = ["ParseResult", "ParseStats", "ToolCall", "ToolCallError", "ToolParser", "holds_non_text", "json_error",
           "not_text", "tool_parameters"]
