"""A Responses API body (``POST /v1/responses``) checked and translated into a chat completions body.

The gateway serves the Responses API over its chat path (see
:mod:`~agentloop_engines.serving.gateway.responses_api`), so this module only translates; the chat
request parser then checks what the translation leaves to it (sampling values, tool schemas,
images, template variables). Every key is in one group, as in
:mod:`~agentloop_engines.serving.gateway.openai_request`, so nothing that would change what is
generated is dropped without a word:

* honoured: ``model``, ``input``, ``instructions`` (a system message first; not carried over
  from ``previous_response_id``, as in OpenAI's API), ``previous_response_id``, ``tools``
  (``function`` tools only), ``tool_choice`` (``auto``/``none``), ``max_output_tokens``,
  ``temperature``, ``top_p``, ``stream``, and the chat extensions ``top_k``, ``seed``,
  ``stop``, ``stop_token_ids``, ``ignore_eos``, ``chat_template_kwargs``;
* accepted and ignored: ``store`` (outside a session nothing is stored anyway), ``metadata``
  and ``user`` (echoed in the response, so checked as OpenAI's API does: ``metadata`` at most 16
  pairs of a key up to 64 characters and a string value up to 512, ``user`` a string),
  ``service_tier``, ``prompt_cache_key``, ``prompt_cache_retention``,
  ``safety_identifier``, ``parallel_tool_calls`` (as chat completions do), ``truncation`` (an
  overlong prompt is refused either way), ``include`` (no encrypted reasoning is made),
  ``stream_options``, ``top_logprobs``, ``reasoning`` (echoed: an object as ``metadata`` is, its
  values scalars) and ``text.verbosity`` (hints a served checkpoint has no input for: its
  template variables are ``chat_template_kwargs``);
* accepted only at their neutral value: ``text.format`` ``{"type": "text"}`` and
  ``background`` false;
* refused with the reason: ``conversation`` and ``prompt`` (nothing is stored server-side
  beyond a session), ``include`` asking for ``message.output_text.logprobs`` (the
  ``token_logprobs`` extension field carries them).

Input items: messages (roles ``user``, ``system``, ``developer``, ``assistant``; content as
text or ``input_text``/``output_text``/``refusal``/``input_image`` parts), ``function_call``,
``function_call_output`` and ``reasoning``. Consecutive assistant-side items (reasoning,
assistant messages, function calls) join one assistant message, as the gateway generated them
in one turn: reasoning text as ``reasoning_content``, message text as ``content``, calls as
``tool_calls`` (a reasoning item after text or calls starts the next turn). Any other item type,
``item_reference`` included, is a 400 naming it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from agentloop_core.protocol import brief_repr
from agentloop_engines.serving.gateway.body_checks import check_known_keys, check_text, translate_tools

__all__ = ["RESPONSES_KEYS", "ResponsesRequest", "input_messages", "parse_responses_request"]

_HONOURED = {"model", "input", "instructions", "previous_response_id", "tools", "tool_choice", "max_output_tokens",
             "temperature", "top_p", "stream"}
_EXTENSIONS = ("top_k", "seed", "stop", "stop_token_ids", "ignore_eos", "chat_template_kwargs")
_IGNORED = {"store", "metadata", "user", "service_tier", "prompt_cache_key", "prompt_cache_retention",
            "safety_identifier", "parallel_tool_calls", "truncation", "include", "stream_options", "top_logprobs",
            "reasoning", "text", "background"}
_REFUSED = {
    "conversation": "the gateway keeps no conversations; send the whole input, or previous_response_id within a "
                    "session",
    "prompt": "the gateway holds no stored prompt templates; send the instructions and input themselves",
}
RESPONSES_KEYS = frozenset(_HONOURED | set(_EXTENSIONS) | _IGNORED | set(_REFUSED))
"""Every key a ``/v1/responses`` body may carry (``conversation`` and ``prompt`` only as null)."""

_MAX_PAIRS, _MAX_KEY_CHARS, _MAX_VALUE_CHARS = 16, 64, 512
"""OpenAI's bounds on ``metadata`` (16 pairs, keys up to 64 characters, values up to 512), which
the gateway applies to every echoed object."""
_TOOL_KEYS = ("name", "description", "parameters", "strict")
_ROLES = ("user", "system", "developer", "assistant")
_TEXT_PARTS = {"input_text": "text", "output_text": "text", "refusal": "refusal"}
_ITEMS = "message, function_call, function_call_output and reasoning"
_brief = brief_repr


@dataclass(frozen=True)
class ResponsesRequest:
    """A checked ``/v1/responses`` body and the chat body it becomes."""

    chat: dict[str, Any]
    """The chat completions body without ``messages`` (the caller adds the conversation)."""
    messages: list[dict[str, Any]]
    """The new ``input`` as chat messages (without the instructions)."""
    instructions: str | None
    """The system message put first, or None."""
    previous_response_id: str | None
    """The stored response whose conversation this one continues, or None."""
    stream: bool
    """Answer as server-sent events."""
    store: bool
    """Keep this response (in its session) for a later ``previous_response_id``."""
    echo: dict[str, Any] = field(default_factory=dict)
    """Request fields the response object repeats (``tools``, ``tool_choice``, ``temperature``...)."""

    def conversation(self, history: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The chat messages of this call: the instructions, ``history`` (the previous
        response's conversation, or nothing) and the new input."""
        system = [{"role": "system", "content": self.instructions}] if self.instructions is not None else []
        return [*system, *history, *self.messages]


def parse_responses_request(body: Any) -> ResponsesRequest:
    """Check a ``/v1/responses`` body and translate it.

    Raises:
        ValueError: naming the unsupported key, value or input item and what to send instead.
    """
    check_known_keys(body, RESPONSES_KEYS, "/v1/responses")
    check_text(body, "/v1/responses")  # the echoed fields too: the answer repeats them
    for key, why in _REFUSED.items():
        if body.get(key) is not None:
            raise ValueError(f"{key!r} is not supported by the agentloop gateway ({why}); leave it out")
    _check_neutral(body)
    chat: dict[str, Any] = {k: body[k] for k in _EXTENSIONS if body.get(k) is not None}
    for key in ("model", "temperature", "top_p"):
        if body.get(key) is not None:
            chat[key] = body[key]
    limit = body.get("max_output_tokens")
    if limit is not None:
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise ValueError(f"'max_output_tokens' must be a positive integer, got {_brief(limit)}")
        chat["max_tokens"] = limit
    tools = translate_tools(body.get("tools"), _chat_tool)
    if tools:
        chat["tools"] = tools
    tool_choice = _tool_choice(body.get("tool_choice"))
    if tool_choice is not None:
        chat["tool_choice"] = tool_choice
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise ValueError(f"'instructions' must be text, got {_brief(instructions)}")
    previous = body.get("previous_response_id")
    if previous is not None and (not isinstance(previous, str) or not previous):
        raise ValueError(f"'previous_response_id' must be a response id, got {_brief(previous)}")
    stream, store = body.get("stream"), body.get("store")
    for key, value in (("stream", stream), ("store", store), ("parallel_tool_calls", body.get("parallel_tool_calls"))):
        if value is not None and not isinstance(value, bool):
            raise ValueError(f"{key!r} must be true or false, got {_brief(value)}")
    echo = {"instructions": instructions, "tools": list(body.get("tools") or ()),
            "tool_choice": body.get("tool_choice") or "auto",
            "parallel_tool_calls": body.get("parallel_tool_calls", True) is not False,
            "temperature": body.get("temperature"), "top_p": body.get("top_p"),
            "max_output_tokens": limit, "previous_response_id": previous, "metadata": body.get("metadata") or {},
            "user": body.get("user"), "reasoning": body.get("reasoning"), "store": store is not False,
            "text": {"format": {"type": "text"}}, "truncation": body.get("truncation") or "disabled"}
    return ResponsesRequest(chat=chat, messages=input_messages(body.get("input")), instructions=instructions,
                            previous_response_id=previous, stream=bool(stream), store=store is not False, echo=echo)


def _check_neutral(body: Mapping[str, Any]) -> None:
    """Refuse the ignored keys' values that would ask for something the gateway does not do."""
    text = body.get("text")
    if text is not None:
        form = text.get("format") if isinstance(text, Mapping) else None
        if not isinstance(text, Mapping) or (form is not None and form != {"type": "text"}):
            raise ValueError(f"text={_brief(text)} is not supported by the agentloop gateway (structured output "
                             "needs constrained decoding, which the gateway does not do); leave 'text' out or send "
                             'text={"format": {"type": "text"}}')
    if body.get("background") not in (None, False):
        raise ValueError("background=true is not supported: the gateway answers while the client waits (or "
                         "streams); leave it out")
    include = body.get("include")
    if include is not None:
        if not isinstance(include, list) or not all(isinstance(v, str) for v in include):
            raise ValueError(f"'include' must be a list of strings, got {_brief(include)}")
        if "message.output_text.logprobs" in include:
            raise ValueError("include=['message.output_text.logprobs'] is not supported: every generated token's "
                             "log-prob is in the response's 'token_logprobs' field (with its id in 'token_ids'); "
                             "leave it out")
    stream_options = body.get("stream_options")
    if stream_options is not None and not isinstance(stream_options, Mapping):
        raise ValueError(f"'stream_options' must be an object, got {_brief(stream_options)}")
    _check_echoed(body)
    truncation = body.get("truncation")
    if truncation not in (None, "auto", "disabled"):
        raise ValueError(f"'truncation' must be 'auto' or 'disabled', got {_brief(truncation)}")


def _check_echoed(body: Mapping[str, Any]) -> None:
    """Refuse an ignored field the response repeats (``metadata``, ``reasoning``, ``user``) in a
    shape OpenAI's API refuses too, before anything is generated: a value the answer could not
    carry would fail only after the call was generated and recorded."""
    metadata = body.get("metadata")
    if metadata is not None:
        _flat_object("metadata", metadata, (str,), "strings")
    reasoning = body.get("reasoning")
    if reasoning is not None:
        _flat_object("reasoning", reasoning, (str, int, float, bool, type(None)), "strings, numbers, booleans or null")
    user = body.get("user")
    if user is not None and (not isinstance(user, str) or len(user) > _MAX_VALUE_CHARS):
        raise ValueError(f"'user' must be a string of at most {_MAX_VALUE_CHARS} characters, got {_brief(user)}")


def _flat_object(key: str, value: Any, kinds: tuple[type, ...], named: str) -> None:
    """Check ``value`` is an object of at most 16 pairs, short string keys and short scalar values."""
    if not isinstance(value, Mapping):
        raise ValueError(f"{key!r} must be an object, got {_brief(value)}")
    if len(value) > _MAX_PAIRS:
        raise ValueError(f"{key!r} has {len(value)} keys; it takes at most {_MAX_PAIRS} key/value pairs (as "
                         "OpenAI's API); send fewer")
    for name, item in value.items():
        if not isinstance(name, str) or len(name) > _MAX_KEY_CHARS:
            raise ValueError(f"{key!r} has the key {_brief(name)}; its keys must be strings of at most "
                             f"{_MAX_KEY_CHARS} characters")
        if not isinstance(item, kinds) or (isinstance(item, str) and len(item) > _MAX_VALUE_CHARS):
            raise ValueError(f"{key}[{name!r}] is {_brief(item)}; {key!r} takes {named} as values (strings of at "
                             f"most {_MAX_VALUE_CHARS} characters, no nested objects or lists, as OpenAI's API "
                             "does); send a flat object")


def _chat_tool(tool: Any, where: str) -> dict[str, Any]:
    """A Responses function tool (flat: ``name``, ``parameters``...) as a chat tool."""
    kind = tool.get("type") if isinstance(tool, Mapping) else None
    if kind != "function":
        raise ValueError(f"{where} has type {_brief(kind)}: the agentloop gateway serves function tools only "
                         "(the agent runs its own tools; built-in tools such as web_search, file_search or "
                         "computer_use are OpenAI's); send {\"type\": \"function\", \"name\": ..., "
                         "\"parameters\": {...}}")
    assert isinstance(tool, Mapping)
    if not isinstance(tool.get("name"), str) or not tool["name"]:
        raise ValueError(f"{where} is a function tool without a 'name'")
    extra = [k for k, v in tool.items() if k not in (*_TOOL_KEYS, "type") and v is not None]
    if extra:
        raise ValueError(f"{where} has {sorted(extra)}, which the gateway does not serve; send name, "
                         "description, parameters and strict only")
    return {"type": "function", "function": {k: tool[k] for k in _TOOL_KEYS if tool.get(k) is not None}}


def _tool_choice(choice: Any) -> str | None:
    if choice is None or choice in ("auto", "none"):
        return choice
    raise ValueError(f"tool_choice={_brief(choice)} cannot be enforced: the gateway does not constrain decoding, so "
                     "the model may or may not call a tool; use 'auto' (or 'none')")


def input_messages(value: Any) -> list[dict[str, Any]]:
    """The chat messages of a Responses ``input`` (text: one user message; a list: its items).

    Raises:
        ValueError: an empty input, an item of an unsupported type or a malformed one, naming it.
    """
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise ValueError(f"'input' must be text or a non-empty list of input items ({_ITEMS}), got {_brief(value)}")
    out: list[dict[str, Any]] = []
    turn: dict[str, Any] | None = None  # the assistant message the current run of output items builds
    for i, item in enumerate(value):
        where = f"input[{i}]"
        if not isinstance(item, Mapping):
            raise ValueError(f"{where} must be an input item object, got {_brief(item)}")
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message" and item.get("role") == "assistant":
            turn = turn if turn is not None else _new_turn(out)
            turn["content"] = (turn["content"] or "") + _assistant_text(item.get("content"), f"{where}.content")
        elif kind == "message":
            role = item.get("role")
            if role not in _ROLES:
                raise ValueError(f"{where}.role must be one of {list(_ROLES)}, got {_brief(role)}")
            turn = None
            out.append({"role": role, "content": _content(item.get("content"), f"{where}.content", role)})
        elif kind == "function_call":
            turn = turn if turn is not None else _new_turn(out)
            turn.setdefault("tool_calls", []).append(_tool_call(item, where))
        elif kind == "reasoning":
            if turn is None or turn["content"] or turn.get("tool_calls"):
                turn = _new_turn(out)
            text = _reasoning_text(item, where)
            if text:
                turn["reasoning_content"] = turn.get("reasoning_content", "") + text
        elif kind == "function_call_output":
            turn = None
            call_id = _text_field(item, "call_id", where)
            content = _content(item.get("output"), f"{where}.output", "tool")
            out.append({"role": "tool", "tool_call_id": call_id, "content": content})
        elif kind == "item_reference":
            raise ValueError(f"{where} is an item_reference: the gateway stores no items to resolve it; send the item "
                             "itself, or previous_response_id (within a session) to continue a response")
        else:
            raise ValueError(f"{where} has type {_brief(kind)}; the agentloop gateway takes {_ITEMS} items")
    return out


def _new_turn(out: list[dict[str, Any]]) -> dict[str, Any]:
    turn: dict[str, Any] = {"role": "assistant", "content": None}
    out.append(turn)
    return turn


def _text_field(item: Mapping[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str) or not value:
        raise ValueError(f"{where}.{key} must be non-empty text, got {_brief(value)}")
    return value


def _tool_call(item: Mapping[str, Any], where: str) -> dict[str, Any]:
    arguments = item.get("arguments")
    if not isinstance(arguments, str):
        raise ValueError(f"{where}.arguments must be the call's arguments as JSON text, got {_brief(arguments)}")
    return {"id": _text_field(item, "call_id", where), "type": "function",
            "function": {"name": _text_field(item, "name", where), "arguments": arguments}}


def _reasoning_text(item: Mapping[str, Any], where: str) -> str:
    """The reasoning an item carries: its ``reasoning_text`` parts (a summary or encrypted content
    is not the model's text, so it is not rendered)."""
    parts = item.get("content") or []
    if not isinstance(parts, list):
        raise ValueError(f"{where}.content must be a list of reasoning_text parts, got {_brief(parts)}")
    texts = []
    for j, part in enumerate(parts):
        if not isinstance(part, Mapping) or part.get("type") != "reasoning_text" or not isinstance(part.get("text"), str):
            raise ValueError(f"{where}.content[{j}] must be {{\"type\": \"reasoning_text\", \"text\": ...}}")
        texts.append(part["text"])
    return "".join(texts)


def _assistant_text(content: Any, where: str) -> str:
    """An assistant message's text (its ``output_text`` and ``refusal`` parts joined)."""
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise ValueError(f"{where} must be text or a list of output_text parts, got {_brief(content)}")
    return "".join(part["text"] for part in _parts(content, where, "assistant"))


def _content(content: Any, where: str, role: str) -> str | list[dict[str, Any]]:
    """Message (or tool output) content as chat content: text, or text and image parts."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ValueError(f"{where} must be text or a list of content parts, got {_brief(content)}")
    return _parts(content, where, role)


def _parts(content: list[Any], where: str, role: str) -> list[dict[str, Any]]:
    parts: list[dict[str, Any]] = []
    for j, part in enumerate(content):
        here = f"{where}[{j}]"
        kind = part.get("type") if isinstance(part, Mapping) else None
        if kind in _TEXT_PARTS:
            assert isinstance(part, Mapping)
            text = part.get(_TEXT_PARTS[kind])
            if not isinstance(text, str):
                raise ValueError(f"{here} is an {kind} part whose {_TEXT_PARTS[kind]!r} is not text")
            parts.append({"type": "text", "text": text})
        elif kind == "input_image" and role != "assistant":
            assert isinstance(part, Mapping)
            url = part.get("image_url")
            if not isinstance(url, str) or not url:
                raise ValueError(f"{here} is an input_image without an image_url (file ids are OpenAI's); send "
                                 "\"image_url\": \"data:image/png;base64,...\"")
            parts.append({"type": "image_url", "image_url": {"url": url}})
        else:
            allowed = "output_text and refusal" if role == "assistant" else "input_text and input_image"
            raise ValueError(f"{here} is a {_brief(kind)} part; the agentloop gateway takes {allowed} parts here")
    return parts
