"""Which turns the agent loop suite drives a loop through: the loop's tools and tool-call format
(found by :func:`discover_profile`), a writer per call format, the scripted turns
(:class:`TurnScript`) and the classification of every engine call into a turn kind.

**Discovery protocol.** A loop may define ``conformance_profile()`` returning a
:class:`LoopProfile` or a mapping with its keys (``tools``, ``tool_parser``, ``interaction``,
``valid_arguments``, ``failing_arguments``). Without it the suite reads, duck-typed:

* tools: ``loop.tools`` (a mapping ``name -> BaseTool | schema`` or a list of OpenAI tool
  schemas), else ``loop.tool_schemas``;
* the call format: ``loop.parser.name`` (an ``agentloop_core.parsers.ToolParser``), else
  ``loop.config.tool_parser`` (a typed config) or ``loop.config["tool_parser"]`` (a dict), else
  ``agentloop_core.parsers.DEFAULT_TOOL_PARSER`` (``hermes``);
* a user turn: ``loop.interactions`` (non-empty) or ``loop.interaction``.

``tool_agent``, ``react_agent`` and ``http_agent`` (no tools declared: its kinds come from what
its agent does) are read this way.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from agentloop_core.parsers import DEFAULT_TOOL_PARSER, tool_function

TOOL_KINDS = ("tool_call", "parallel_calls", "malformed_call", "unknown_tool", "tool_error")
"""Turn kinds in which the model calls a tool (well-formed or not)."""
ALL_KINDS = (*TOOL_KINDS, "truncated", "user_turn", "final_answer")
"""Every kind the suite reports, in report order."""

UNKNOWN_TOOL = "agentloop_conformance_no_such_tool"
"""The tool name the ``unknown_tool`` turn calls."""


@dataclass
class LoopProfile:
    """What the suite knows about a loop's tools and turns."""

    tools: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Declared tools: name -> OpenAI function schema (``{"name", "parameters", ...}``)."""
    tool_parser: str = DEFAULT_TOOL_PARSER
    """The call format (an ``agentloop_core.parsers`` name)."""
    interaction: bool = False
    """Whether the loop answers a plain-text turn with a user turn."""
    valid_arguments: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Arguments that make a tool succeed; missing tools get arguments made from the schema."""
    failing_arguments: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Arguments that make a tool fail (the ``tool_error`` turn); empty: probed (see
    :func:`probe_failing_arguments`) or that kind is skipped."""
    tool_objects: dict[str, Any] = field(default_factory=dict, repr=False)
    """The loop's tool objects, for probing."""


def _function_schema(spec: Any) -> dict[str, Any] | None:
    function = tool_function(spec)
    return function if function is not None and function.get("name") else None


def discover_profile(loop: Any) -> LoopProfile:
    """The loop's :class:`LoopProfile`, by the protocol in the module docstring."""
    declared = getattr(loop, "conformance_profile", None)
    if callable(declared):
        # Any, not the object a callable() check infers: the protocol promises a LoopProfile or
        # a mapping of its fields, and dict() below says so when a loop breaks it.
        made: Any = declared()
        if isinstance(made, LoopProfile):
            return made
        made = dict(made or {})
        tools = made.pop("tools", {}) or {}
        profile = LoopProfile(**made)
        profile.tools = _schemas(tools)
        return profile
    raw = getattr(loop, "tools", None)
    if raw is None:
        raw = getattr(loop, "tool_schemas", None)
    parser = getattr(getattr(loop, "parser", None), "name", None)
    if not isinstance(parser, str) or not parser:
        config = getattr(loop, "config", None)
        parser = config.get("tool_parser") if isinstance(config, Mapping) else getattr(config, "tool_parser", None)
    interaction = bool(getattr(loop, "interactions", None) or getattr(loop, "interaction", None))
    objects = dict(raw) if isinstance(raw, Mapping) else {}
    return LoopProfile(_schemas(raw or {}), parser if isinstance(parser, str) and parser else DEFAULT_TOOL_PARSER,
                       interaction, tool_objects=objects)


def _schemas(raw: Any) -> dict[str, dict[str, Any]]:
    items = raw.values() if isinstance(raw, Mapping) else list(raw)
    out = {}
    for spec in items:
        schema = _function_schema(spec)
        if schema is not None:
            out[schema["name"]] = schema
    return out


def example_arguments(schema: Mapping[str, Any]) -> dict[str, Any]:
    """Schema-valid arguments for a tool: each required parameter with a plain value of its type
    (strings ``"2 + 3"``, numbers 1, enums their first value)."""
    params = schema.get("parameters") or {}
    props = params.get("properties") or {}
    out: dict[str, Any] = {}
    for name in params.get("required") or []:
        prop = props.get(name) or {}
        if prop.get("enum"):
            out[name] = prop["enum"][0]
            continue
        kind = prop.get("type", "string")
        kind = kind[0] if isinstance(kind, list) else kind
        out[name] = {"string": "2 + 3", "integer": 1, "number": 1, "boolean": True, "array": [],
                     "object": {}}.get(kind, "2 + 3")
    return out


_FAILING_CANDIDATES = {"string": ("1/0", "", "\x00"), "integer": (-1, 0), "number": (-1, 0)}


async def probe_failing_arguments(profile: LoopProfile) -> None:
    """Find, for each tool given as an agentloop ``BaseTool`` (``create``/``run_execute``/
    ``release``), schema-valid arguments on which it raises or answers ``Error...``; store them
    in ``profile.failing_arguments``. Runs the tool once per candidate, on its own instance."""
    for name, tool in profile.tool_objects.items():
        if name in profile.failing_arguments or name not in profile.tools:
            continue
        if not all(hasattr(tool, a) for a in ("create", "run_execute", "release")):
            continue
        base = example_arguments(profile.tools[name])
        props = (profile.tools[name].get("parameters") or {}).get("properties") or {}
        for param in base:
            kind = (props.get(param) or {}).get("type", "string")
            for value in _FAILING_CANDIDATES.get(kind if isinstance(kind, str) else "string", ()):
                args = {**base, param: value}
                if await _fails(tool, args):
                    profile.failing_arguments[name] = args
                    break
            if name in profile.failing_arguments:
                break


async def _fails(tool: Any, args: dict[str, Any]) -> bool:
    try:
        instance = await tool.create()
    except Exception:  # noqa: BLE001 - a tool that cannot be created is probed no further
        return False
    try:
        result = await tool.run_execute(instance, dict(args))
    except Exception:  # noqa: BLE001 - raising is what we look for
        return True
    finally:
        with contextlib.suppress(Exception):  # a failing release does not change the verdict
            await tool.release(instance)
    text = getattr(result[0], "text", "") if isinstance(result, tuple) and result else ""
    return isinstance(text, str) and text.lstrip().lower().startswith("error")


# -- call writers ----------------------------------------------------------------------------------

def _hermes(calls: Sequence[tuple[str, dict]]) -> str:
    return "\n".join("<tool_call>\n" + json.dumps({"name": n, "arguments": a}) + "\n</tool_call>" for n, a in calls)


def _llama3(calls: Sequence[tuple[str, dict]]) -> str:
    return "; ".join(json.dumps({"name": n, "parameters": a}) for n, a in calls)


def _harmony(calls: Sequence[tuple[str, dict]]) -> str:
    parts = [f"<|channel|>commentary to=functions.{n} <|constrain|>json<|message|>{json.dumps(a)}" for n, a in calls]
    # <|call|> stops the turn, so earlier calls of a parallel turn close with <|end|>.
    return "<|end|><|start|>assistant".join(parts) + "<|call|>"


def _mistral(calls: Sequence[tuple[str, dict]]) -> str:
    return "[TOOL_CALLS]" + json.dumps([{"name": n, "arguments": a, "id": f"abcdefg{i:02d}"}
                                        for i, (n, a) in enumerate(calls)])


CALL_WRITERS: dict[str, Callable[[Sequence[tuple[str, dict]]], str]] = {
    "hermes": _hermes, "llama3_json": _llama3, "gpt_oss": _harmony, "harmony": _harmony, "mistral": _mistral}
"""Per call format: ``[(name, arguments), ...] -> text`` of one turn making those calls."""

_MALFORMED: dict[str, str] = {
    "hermes": '<tool_call>\n{"name": "%s", "arguments": {\n</tool_call>',
    "llama3_json": '<|python_tag|>{"name": "%s", "parameters": {',
    "gpt_oss": '<|channel|>commentary to=functions.%s <|constrain|>json<|message|>{"x": <|call|>',
    "mistral": '[TOOL_CALLS][{"name": "%s", "arguments": {]',
}
_MALFORMED["harmony"] = _MALFORMED["gpt_oss"]


def write_calls(parser: str, calls: Sequence[tuple[str, dict[str, Any]]]) -> str:
    """The text of one assistant turn making ``calls`` in ``parser``'s format.

    Raises:
        KeyError: no writer for that format (see :data:`CALL_WRITERS`).
    """
    return CALL_WRITERS[parser](calls)


def write_malformed_call(parser: str, name: str) -> str:
    """A call to ``name`` in ``parser``'s format whose arguments are cut-off JSON."""
    return _MALFORMED[parser] % name


# -- the script ------------------------------------------------------------------------------------

FINAL_ANSWER = "The answer is 5.\n#### 5"


class TurnScript:
    """Scripted replies exercising every kind of turn a loop with tools can meet, one scenario
    per row (the suite rolls out as many rows as there are scenarios):

    * a valid call, parallel calls, a final answer;
    * a malformed call (cut-off JSON arguments), a final answer;
    * a call to an unknown tool, a final answer;
    * a call that makes a tool fail (when failing arguments are known or probed), a final answer;
    * a valid call, then a turn longer than ``max_tokens`` (truncated);
    * (a loop with an interaction) a plain answer, the user's reply, a final answer;
    * valid calls until the loop's budget or turn limit ends the trajectory.

    Use it as the scripted engine's replies: ``script(request_id, prompt_ids, index)``. Set
    :attr:`row` before each row's rollout; requests first seen then play that row's scenario.
    """

    def __init__(self, profile: LoopProfile, tokenizer: Any) -> None:
        from agentloop_conformance.recording import non_canonical_ids

        self.profile = profile
        self.row = 0
        self.skipped: dict[str, str] = {}
        self.labels: dict[tuple[str, int], str] = {}
        self._scenario_of: dict[str, int] = {}
        parser = profile.tool_parser
        if parser not in CALL_WRITERS:
            raise KeyError(parser)
        names = sorted(profile.tools)
        first = names[0]
        second = names[1] if len(names) > 1 else first

        def call(name: str) -> tuple[str, dict]:
            return name, profile.valid_arguments.get(name) or example_arguments(profile.tools[name])

        # Text before the call where the format allows it (llama3_json calls are the whole turn).
        prefix = "I will use a tool. " if parser in ("hermes", "mistral") else ""
        valid = ("tool_call", prefix + write_calls(parser, [call(first)]))
        final = ("final_answer", FINAL_ANSWER)
        # One scenario per kind of bad call: a loop may end the trajectory on one.
        self.scenarios: list[list[tuple[str, str]]] = [
            [valid, ("parallel_calls", write_calls(parser, [call(first), call(second)])), final],
            [("malformed_call", write_malformed_call(parser, first)), final],
            [("unknown_tool", write_calls(parser, [(UNKNOWN_TOOL, {})])), final]]
        failing = next(((n, a) for n, a in profile.failing_arguments.items() if n in profile.tools), None)
        if failing is not None:
            self.scenarios.append([("tool_error", write_calls(parser, [failing])), final])
        else:
            self.skipped["tool_error"] = ("no arguments known to make a tool fail: give "
                                          "conformance_profile()['failing_arguments'] = {tool: arguments}")
        longest = max(len(non_canonical_ids(tokenizer, text)) for sc in self.scenarios for _, text in sc)
        self.max_tokens = longest + 8
        """A per-turn ``max_tokens`` that every scripted turn but the truncated one fits in."""
        long_text = " ".join(["and so on"] * self.max_tokens)
        self.scenarios.append([valid, ("truncated", long_text)])
        if profile.interaction:
            self.scenarios.append([("final_answer", "I think it is 5."), ("final_answer", FINAL_ANSWER)])
        else:
            self.skipped["user_turn"] = "the loop has no interaction: no user turns to drive"
        self.scenarios.append([valid])

    def __call__(self, request_id: str, prompt_ids: list[int], index: int) -> str:
        scenario = self.scenarios[self._scenario_of.setdefault(request_id, self.row % len(self.scenarios))]
        kind, text = scenario[min(index, len(scenario) - 1)]
        self.labels[(request_id, index)] = kind
        return text


def classify_text(text: str, parser: Any, tools: Mapping[str, Any]) -> str:
    """The turn kind of one generated turn's text (``final_answer`` when it calls nothing)."""
    if parser is None:
        return "final_answer"
    try:
        parsed = parser.parse(text, dict(tools) or None)
    except Exception:  # noqa: BLE001 - a parser that raises classifies nothing
        return "final_answer"
    if any(e.kind == "unknown_tool" for e in parsed.errors):
        return "unknown_tool"
    if parsed.errors:
        return "malformed_call"
    if len(parsed.calls) > 1:
        return "parallel_calls"
    return "tool_call" if parsed.calls else "final_answer"


def load_parser(name: str) -> Any:
    """``agentloop_core.parsers.get_tool_parser(name)``, or None for an unknown name."""
    from agentloop_core.parsers import get_tool_parser

    try:
        return get_tool_parser(name)
    except Exception:  # noqa: BLE001
        return None


def decode_turn(tokenizer: Any, ids: Sequence[int], parser: Any) -> str:
    """A generated turn's text as its parser reads it."""
    keep = bool(getattr(parser, "needs_special_tokens", False))
    return tokenizer.decode(list(ids), skip_special_tokens=not keep)
