"""Anthropic Messages request bodies checked and translated into chat completions bodies.

The chat path then answers them (:mod:`~agentloop_engines.serving.gateway.messages_api`), so a
conversation sent as Messages renders to the same prompt ids as the same conversation sent as
chat completions. No I/O here.

How a Messages body becomes a chat body:

* ``system`` (text or text blocks) is the first message, role system;
* a user message's ``text`` and ``image`` blocks are one user message (a base64 source becomes
  a data URL, a ``url`` source the URL, which the gateway fetches only with
  ``allow_remote_image_urls``); its ``tool_result`` blocks are tool messages
  (``tool_call_id`` = ``tool_use_id``, content text or text and image blocks) placed before
  the rest of that user message, since they answer the previous assistant turn's calls.
  ``is_error`` is accepted and not rendered: chat templates have no place for it;
* an assistant message's ``text`` blocks are its content (joined with newlines; joined with
  nothing where that is the reply the session returned, as a streamed reply's text before and
  after its calls comes back: :func:`match_streamed_replies`), ``tool_use`` blocks its
  ``tool_calls`` (the id kept, the input as JSON arguments), ``thinking`` blocks its
  ``reasoning_content``; ``redacted_thinking`` blocks are dropped (Anthropic's encrypted
  reasoning holds no text a template could render, and the gateway never returns one);
* custom ``tools`` are function tools; ``tool_choice`` ``auto`` is the default and ``none``
  chat's ``none``; ``disable_parallel_tool_use`` is accepted and ignored, as chat's
  ``parallel_tool_calls`` is; ``stop_sequences`` is ``stop``; ``max_tokens``,
  ``temperature``, ``top_p`` and ``top_k`` are passed as they are;
* ``thinking``: ``enabled``, ``adaptive`` or ``between_tools`` return the reasoning the
  gateway's reasoning parser separates as a ``thinking`` block before the text, and set the
  template variable ``enable_thinking`` to true when the server allows it
  (:attr:`PromptLimits.template_variables`); ``disabled`` sets it to false likewise; without
  ``thinking`` the template's default applies. Only a request that enables thinking gets
  thinking blocks (a client that did not ask reads ``content[0].text``); the reasoning's
  tokens are in ``token_ids`` either way. ``budget_tokens`` is checked, not enforced: the
  gateway does not steer decoding.

A message with role ``system`` inside ``messages`` (Claude Code sends its environment notes so)
is a system message at its place; the chat template decides whether it renders one there.

Accepted and ignored, as they do not change what is generated: ``metadata``,
``cache_control`` (top level and on blocks), ``service_tier``, ``inference_geo``, ``speed``,
``diagnostics``, ``output_config.effort``, ``citations`` on text blocks, ``defer_loading`` on
tools (every tool sent is rendered), ``thinking.display`` other than ``omitted``, and
``context_management`` (server-side context editing: the gateway edits no context, so the
agent's messages are rendered as sent and an agent relying on the server to clear old tool
results keeps them; Claude Code sends it). Refused with a 400
naming the key or block type: a missing ``model``, ``max_tokens`` or ``messages``; server tools
(a tool with a ``type`` such as ``web_search_20250305``), ``container``, ``mcp_servers``,
``output_config.format`` and ``tool_choice`` ``any`` or
``tool`` (they need constrained decoding); ``document`` and every other block type not listed
above; a last assistant message (prefill: chat templates close every assistant turn they
render); and any other key.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from agentloop_core.protocol import brief_repr
from agentloop_engines.serving.gateway.body_checks import check_known_keys, check_text, translate_tools
from agentloop_engines.serving.gateway.continuation import normalize_message
from agentloop_engines.serving.gateway.prompt_limits import PromptLimits

__all__ = ["MessagesRequest", "match_streamed_replies", "to_chat_body"]

_IGNORED = frozenset({"cache_control", "output_config", "speed", "context_management"})
_CREATE_KEYS = frozenset({"model", "max_tokens", "messages", "system", "stop_sequences", "stream", "temperature",
                          "top_p", "top_k", "tools", "tool_choice", "thinking", "metadata", "service_tier",
                          "inference_geo", "diagnostics"} | _IGNORED)
_COUNT_KEYS = frozenset({"model", "messages", "system", "tools", "tool_choice", "thinking"} | _IGNORED)
_REFUSED = {
    "container": "code execution containers belong to Anthropic's server tools; the gateway serves client tools",
    "mcp_servers": "the gateway connects to no MCP server; connect it in the agent and send its tools as 'tools'",
}
_THINKING_ON = frozenset({"enabled", "adaptive", "between_tools"})
_TOOL_KEYS = frozenset({"name", "description", "input_schema", "type", "cache_control", "strict",
                        "eager_input_streaming", "defer_loading"})
_brief = brief_repr


@dataclass(frozen=True)
class MessagesRequest:
    """A checked Messages body and the chat body that answers it."""

    chat: dict[str, Any]
    """The chat completions body (``stream`` left out: the caller picks the chat call)."""
    stream: bool
    """The client asked for server-sent events."""
    thinking: bool
    """Return the reasoning as ``thinking`` blocks (the request enabled thinking)."""
    omit_thinking: bool
    """``thinking.display`` is ``omitted``: thinking blocks come back empty."""
    stop_sequences: tuple[str, ...]
    """The request's stop strings, to name the one that matched."""
    joined: Mapping[int, str] = field(default_factory=dict)
    """The assistant messages (by index in ``chat["messages"]``) of several text blocks, their
    texts joined with nothing: a streamed reply's text before and after its calls comes back
    so, and is the session's returned reply only joined so (see :func:`match_streamed_replies`)."""


def to_chat_body(body: Any, limits: PromptLimits, *, count: bool = False) -> MessagesRequest:
    """Check a Messages body and translate it into a chat completions body.

    Args:
        body: The decoded JSON body of ``/v1/messages`` (or, with ``count``,
            ``/v1/messages/count_tokens``, which takes no sampling keys and no ``max_tokens``).
        limits: The gateway's prompt limits (which template variables a request may set).
        count: Check the body as a ``count_tokens`` body.

    Raises:
        ValueError: naming the key, message or block that is missing, malformed or unsupported.
    """
    endpoint = "/v1/messages/count_tokens" if count else "/v1/messages"
    _check_keys(body, _COUNT_KEYS if count else _CREATE_KEYS, endpoint)
    required = ("model", "messages") if count else ("model", "max_tokens", "messages")
    missing = [k for k in required if body.get(k) is None]
    if missing:
        raise ValueError(f"{endpoint} requires {missing[0]!r}; send it (e.g. {{\"model\": \"...\", "
                         "\"max_tokens\": 1024, \"messages\": [{\"role\": \"user\", \"content\": \"Hello\"}]})")
    if not isinstance(body["model"], str):
        raise ValueError(f"'model' must be a string, got {_brief(body['model'])}")
    joined: dict[int, str] = {}
    chat: dict[str, Any] = {"model": body["model"], "messages": _messages(body, joined)}
    for key in ("max_tokens", "temperature", "top_p", "top_k"):
        if body.get(key) is not None:
            chat[key] = body[key]  # their types and ranges are checked by the chat path, naming the key
    stops = _stop_sequences(body.get("stop_sequences"))
    if stops:
        chat["stop"] = list(stops)
    tools = translate_tools(body.get("tools"), _chat_tool)
    if tools:
        chat["tools"] = tools
    if _tool_choice(body.get("tool_choice")) == "none":
        chat["tool_choice"] = "none"
    thinking, omit = _thinking(body.get("thinking"), limits, chat)
    _output_config(body.get("output_config"))
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise ValueError(f"'stream' must be true or false, got {_brief(stream)}")
    return MessagesRequest(chat=chat, stream=bool(stream), thinking=thinking, omit_thinking=omit,
                           stop_sequences=stops, joined=joined)


def match_streamed_replies(req: MessagesRequest, expected: Sequence[str]) -> None:
    """Join the text blocks of ``req``'s assistant messages with nothing (instead of newlines)
    where that, and only that, is the message a session's last call expects at that place
    (``expected``: its :attr:`ChatState.expected`). A streamed reply with text after its calls
    comes to the client as text, tool_use and text blocks; sent back, they are the reply the
    gateway returned only joined so, and the call then continues the session's ids."""
    messages = req.chat["messages"]
    for index, text in req.joined.items():
        if index < len(expected) and normalize_message(messages[index]) != expected[index]:
            candidate = {**messages[index], "content": text}
            if normalize_message(candidate) == expected[index]:
                messages[index] = candidate


def _check_keys(body: Any, allowed: frozenset[str], endpoint: str) -> None:
    for key, why in _REFUSED.items() if isinstance(body, Mapping) else ():
        if body.get(key) not in (None, [], {}):
            raise ValueError(f"{key!r} is not supported by the agentloop gateway ({why}); leave it out")
    check_known_keys(body, allowed, endpoint, ignore=_REFUSED)
    check_text(body, endpoint)


def _messages(body: Mapping[str, Any], joined: dict[int, str]) -> list[dict[str, Any]]:
    messages = body["messages"]
    if not isinstance(messages, list) or not messages:
        raise ValueError("'messages' must be a non-empty list of {\"role\": \"user\" or \"assistant\", "
                         "\"content\": ...} objects")
    out: list[dict[str, Any]] = []
    system = body.get("system")
    if system is not None:
        out.append({"role": "system", "content": _system(system)})
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        role = message.get("role") if isinstance(message, Mapping) else None
        if role not in ("user", "assistant", "system"):
            raise ValueError(f"{where} must be an object with 'role' 'user' or 'assistant' (the system prompt is "
                             f"the top-level 'system'), got role {_brief(role)}")
        assert isinstance(message, Mapping)
        content = message.get("content")
        if role == "system":  # Claude Code sends some of its context so, mid-conversation
            out.append({"role": "system", "content": _system(content)})
            continue
        if not isinstance(content, (str, list)):
            raise ValueError(f"{where}.content must be text or a list of content blocks, got {_brief(content)}")
        if role == "assistant":
            message, texts = _assistant(content, where)
            if len(texts) > 1 and "".join(texts) != message["content"]:
                joined[len(out)] = "".join(texts)
            out.append(message)
        else:
            out.extend(_user(content, where))
    if messages[-1].get("role") == "assistant":
        raise ValueError(f"messages[{len(messages) - 1}] is an assistant message last (prefill), which the gateway "
                         "cannot continue: chat templates close every assistant turn they render; end with a "
                         "user message")
    return out


def _system(system: Any) -> str | list[dict[str, Any]]:
    if isinstance(system, str):
        return system
    if isinstance(system, list):
        return [_text_part(block, f"system[{j}]") for j, block in enumerate(system)]
    raise ValueError(f"'system' must be text or a list of text blocks, got {_brief(system)}")


def _kind(block: Any) -> str:
    return str(block.get("type"))[:40] if isinstance(block, Mapping) else type(block).__name__


def _text_part(block: Any, where: str) -> dict[str, Any]:
    if _kind(block) != "text":
        raise ValueError(f"{where} is a {_kind(block)!r} block where a text block is expected")
    if not isinstance(block.get("text"), str):
        raise ValueError(f"{where} is a text block whose 'text' is not a string")
    return {"type": "text", "text": block["text"]}


def _image_part(block: Mapping[str, Any], where: str) -> dict[str, Any]:
    if block.get("transformations") is not None:
        raise ValueError(f"{where}.transformations is not supported: the model's processor decides the image's "
                         "size; send the image as it should be seen")
    source = block.get("source")
    kind = source.get("type") if isinstance(source, Mapping) else None
    if kind == "base64" and isinstance(source, Mapping):
        media, data = source.get("media_type"), source.get("data")
        if not isinstance(media, str) or not isinstance(data, str):
            raise ValueError(f"{where}.source needs 'media_type' (such as \"image/png\") and base64 'data' strings")
        return {"type": "image_url", "image_url": {"url": f"data:{media};base64,{data}"}}
    if kind == "url" and isinstance(source, Mapping):
        if not isinstance(source.get("url"), str):
            raise ValueError(f"{where}.source.url must be a string")
        return {"type": "image_url", "image_url": {"url": source["url"]}}
    raise ValueError(f"{where}.source must be {{\"type\": \"base64\", \"media_type\", \"data\"}} or "
                     f"{{\"type\": \"url\", \"url\"}}, got source type {_brief(kind)} (files uploaded to the Files "
                     "API are not served)")


def _unsupported(block: Any, where: str, role: str, kinds: str) -> ValueError:
    return ValueError(f"{where} is a {_kind(block)!r} block, which the gateway does not serve in {role} messages; "
                      f"it takes {kinds} blocks")


def _user(content: str | list[Any], where: str) -> list[dict[str, Any]]:
    """The chat messages of one user message: its tool results first (they answer the previous
    assistant turn's calls), then the rest as one user message."""
    if isinstance(content, str):
        return [{"role": "user", "content": content}]
    tools: list[dict[str, Any]] = []
    parts: list[dict[str, Any]] = []
    for j, block in enumerate(content):
        here = f"{where}.content[{j}]"
        kind = _kind(block)
        if kind == "text":
            parts.append(_text_part(block, here))
        elif kind == "image":
            parts.append(_image_part(block, here))
        elif kind == "tool_result":
            tools.append(_tool_message(block, here))
        else:
            raise _unsupported(block, here, "user", "text, image and tool_result")
    if tools and not parts:
        return tools
    return [*tools, {"role": "user", "content": parts}]


def _tool_message(block: Mapping[str, Any], where: str) -> dict[str, Any]:
    call_id = block.get("tool_use_id")
    if not isinstance(call_id, str) or not call_id:
        raise ValueError(f"{where} is a tool_result without a 'tool_use_id' string; send the id of the tool_use "
                         "block it answers")
    content = block.get("content")
    if content is None:
        content = ""
    elif isinstance(content, list):
        parts = []
        for k, part in enumerate(content):
            here = f"{where}.content[{k}]"
            if _kind(part) == "image":
                parts.append(_image_part(part, here))
            elif _kind(part) == "text":
                parts.append(_text_part(part, here))
            else:
                raise ValueError(f"{here} is a {_kind(part)!r} block; a tool_result holds text and image blocks")
        content = parts
    elif not isinstance(content, str):
        raise ValueError(f"{where}.content must be text or a list of text and image blocks, got {_brief(content)}")
    return {"role": "tool", "tool_call_id": call_id, "content": content}


def _assistant(content: str | list[Any], where: str) -> tuple[dict[str, Any], list[str]]:
    """The chat message of an assistant message, and the texts of its text blocks."""
    if isinstance(content, str):
        return {"role": "assistant", "content": content}, [content]
    texts: list[str] = []
    thoughts: list[str] = []
    calls: list[dict[str, Any]] = []
    for j, block in enumerate(content):
        here = f"{where}.content[{j}]"
        kind = _kind(block)
        if kind == "text":
            texts.append(_text_part(block, here)["text"])
        elif kind == "tool_use":
            calls.append(_tool_call(block, here))
        elif kind == "thinking":
            if not isinstance(block.get("thinking"), str):
                raise ValueError(f"{here} is a thinking block whose 'thinking' is not a string")
            thoughts.append(block["thinking"])
        elif kind != "redacted_thinking":
            raise _unsupported(block, here, "assistant", "text, tool_use, thinking and redacted_thinking")
    # Joined as the chat path joins text parts, so both APIs render one conversation alike.
    message: dict[str, Any] = {"role": "assistant", "content": "\n".join(texts)}
    if thoughts:
        message["reasoning_content"] = "\n".join(thoughts)
    if calls:
        message["tool_calls"] = calls
    return message, texts


def _tool_call(block: Mapping[str, Any], where: str) -> dict[str, Any]:
    call_id, name, arguments = block.get("id"), block.get("name"), block.get("input")
    if not isinstance(call_id, str) or not isinstance(name, str) or not isinstance(arguments, Mapping):
        raise ValueError(f"{where} is a tool_use block that needs an 'id' and a 'name' string and an 'input' object")
    try:
        text = json.dumps(arguments, ensure_ascii=False)
    except (TypeError, ValueError, RecursionError) as exc:
        raise ValueError(f"{where}.input is not JSON the gateway can encode: {type(exc).__name__}") from None
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": text}}


def _stop_sequences(stops: Any) -> tuple[str, ...]:
    if stops is None:
        return ()
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise ValueError(f"'stop_sequences' must be a list of non-empty strings, got {_brief(stops)}")
    return tuple(dict.fromkeys(stops))


def _chat_tool(tool: Any, where: str) -> dict[str, Any]:
    """A custom tool as a chat tool."""
    if not isinstance(tool, Mapping):
        raise ValueError(f"{where} must be an object {{\"name\", \"description\", \"input_schema\"}}")
    kind = tool.get("type")
    if kind not in (None, "custom"):
        raise ValueError(f"{where} is a server tool of type {_brief(kind)}, which runs on Anthropic's servers; the "
                         "gateway serves custom tools only ({\"name\", \"description\", \"input_schema\"}): run "
                         "the tool in the agent")
    unknown = sorted(str(k)[:80] for k in tool if k not in _TOOL_KEYS)
    if unknown:
        raise ValueError(f"{where} has unsupported key(s) {unknown[:10]}; a tool takes {sorted(_TOOL_KEYS)}")
    if not isinstance(tool.get("name"), str) or not isinstance(tool.get("input_schema"), Mapping):
        raise ValueError(f"{where} needs a 'name' string and an 'input_schema' object")
    function: dict[str, Any] = {"name": tool["name"]}
    if tool.get("description") is not None:
        function["description"] = tool["description"]
    function["parameters"] = dict(tool["input_schema"])
    if tool.get("strict") is not None:  # as chat and Responses tools carry it (no decoding is constrained)
        function["strict"] = tool["strict"]
    return {"type": "function", "function": function}


def _tool_choice(choice: Any) -> str | None:
    if choice is None:
        return None
    kind = choice.get("type") if isinstance(choice, Mapping) else None
    if kind in ("auto", "none"):
        return kind
    if kind in ("any", "tool"):
        raise ValueError(f"tool_choice type {kind!r} cannot be enforced: the gateway does not constrain decoding, so "
                         "the model may or may not call a tool; use {\"type\": \"auto\"} (or \"none\")")
    raise ValueError(f"'tool_choice' must be {{\"type\": \"auto\"}} or {{\"type\": \"none\"}}, got {_brief(choice)}")


def _thinking(thinking: Any, limits: PromptLimits, chat: dict[str, Any]) -> tuple[bool, bool]:
    """``(return thinking blocks, leave their text out)``; sets ``enable_thinking`` in ``chat``'s
    template variables when the request chose and the server allows it."""
    if thinking is None:
        return False, False
    kind = thinking.get("type") if isinstance(thinking, Mapping) else None
    if kind not in (*_THINKING_ON, "disabled"):
        raise ValueError(f"'thinking' must be {{\"type\": \"enabled\", \"budget_tokens\": N}}, {{\"type\": "
                         f"\"adaptive\"}} or {{\"type\": \"disabled\"}}, got {_brief(thinking)}")
    assert isinstance(thinking, Mapping)
    budget = thinking.get("budget_tokens")
    if kind == "enabled" and (isinstance(budget, bool) or not isinstance(budget, int) or budget < 1):
        raise ValueError(f"'thinking.budget_tokens' must be a positive integer, got {_brief(budget)}")
    display = thinking.get("display")
    if display is not None and not isinstance(display, str):
        raise ValueError(f"'thinking.display' must be a string such as \"summarized\" or \"omitted\", got "
                         f"{_brief(display)}")
    on = kind in _THINKING_ON
    if "enable_thinking" in limits.template_variables:
        chat["chat_template_kwargs"] = {"enable_thinking": on}
    return on, display == "omitted"


def _output_config(config: Any) -> None:
    if config is None:
        return
    if not isinstance(config, Mapping):
        raise ValueError(f"'output_config' must be an object, got {_brief(config)}")
    if config.get("format") is not None:
        raise ValueError("'output_config.format' (structured output) needs constrained decoding, which the gateway "
                         "does not do; leave it out and validate the answer in the agent")
    unknown = sorted(str(k)[:80] for k in config if k not in ("effort", "format"))
    if unknown:
        raise ValueError(f"'output_config' has unsupported key(s) {unknown[:10]}; it takes 'effort' (ignored)")
