"""OpenAI request bodies checked and turned into what a token-level engine needs.

Every key of a request is in one of three groups, so nothing is silently dropped that would
change what is generated:

* honoured: ``messages``/``prompt`` (text and, in user and tool messages, ``image_url`` parts:
  see :mod:`~agentloop_engines.serving.gateway.images`), ``model``, ``max_tokens``/``max_completion_tokens``,
  ``temperature``, ``top_p``, ``seed``, ``stop``, ``stream``, ``stream_options``, ``tools``,
  ``tool_choice`` (``auto``/``none``), ``logprobs``, and the extensions ``top_k``,
  ``stop_token_ids``, ``ignore_eos``, ``chat_template_kwargs`` (only the template variables the
  server allows, see :mod:`~agentloop_engines.serving.gateway.prompt_limits`), ``add_special_tokens``;
* accepted and ignored, as they do not change sampling: ``user``, ``metadata``, ``store``,
  ``parallel_tool_calls``, ``service_tier``, ``prompt_cache_key``, ``safety_identifier``,
  ``top_logprobs`` (top lists come back empty);
* accepted only at their neutral value (``n=1``, zero penalties, empty ``logit_bias``, text
  ``response_format``...): anything else would change the distribution the engine samples
  from (and so the log-probs a trainer relies on) or ask for something the engine cannot do,
  so it is a 400 naming the key.

Any other key is a 400 naming it. Values have their JSON type or are a 400 naming the key and
the type expected: the sampling keys are checked by core's
:class:`~agentloop_core.protocol.SamplingParams`, the one validator of every entry point
(``"false"`` is not a boolean, ``"123"`` not a list of token ids, ``true`` not a number).
Error messages quote a hostile value shortened, never whole.
"""

from __future__ import annotations

import json
import numbers
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from agentloop_core.protocol import SamplingParams, brief_repr
from agentloop_engines.serving.gateway.body_checks import check_known_keys, check_text
from agentloop_engines.serving.gateway.images import content_parts, count_images
from agentloop_engines.serving.gateway.prompt_limits import PromptLimits
from agentloop_engines.serving.gateway.stop import normalize_stop

__all__ = ["ChatRequest", "CompletionRequest", "parse_chat_request", "parse_completion_request"]

_SAMPLING = {"max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "seed",
             "stop_token_ids", "ignore_eos"}
_IGNORED = {"user", "metadata", "store", "parallel_tool_calls", "service_tier", "prompt_cache_key",
            "safety_identifier", "top_logprobs"}
_COMMON = _SAMPLING | _IGNORED | {"model", "stream", "stream_options", "stop"}

_WHY_SAMPLING = ("the gateway samples from the engine's own distribution, so the recorded log-probs are "
                 "the ones a trainer recomputes")
_brief = brief_repr


def _number(value: Any, neutral: float) -> bool:
    # true == 1 in Python, but n=true is a client's mistake, not a neutral value.
    return not isinstance(value, bool) and isinstance(value, numbers.Real) and value == neutral


# key -> (is the value neutral, the neutral value as text, why anything else is refused)
_NEUTRAL: dict[str, tuple[Callable[[Any], bool], str, str]] = {
    "n": (lambda v: _number(v, 1), "1", "send n separate requests (one generation each is recorded)"),
    "presence_penalty": (lambda v: _number(v, 0), "0", _WHY_SAMPLING),
    "frequency_penalty": (lambda v: _number(v, 0), "0", _WHY_SAMPLING),
    "repetition_penalty": (lambda v: _number(v, 1), "1", _WHY_SAMPLING),
    "logit_bias": (lambda v: isinstance(v, Mapping) and not v, "{}", _WHY_SAMPLING),
    "response_format": (lambda v: v == {"type": "text"}, '{"type": "text"}',
                        "structured output needs constrained decoding, which the gateway does not do"),
    "modalities": (lambda v: v == ["text"], '["text"]', "the gateway answers with text only"),
    "best_of": (lambda v: _number(v, 1), "1", "send separate requests"),
    "echo": (lambda v: v is False, "false", "the prompt is returned as prompt_token_ids instead"),
    "suffix": (lambda v: v == "", '""', "the gateway does not fill in the middle"),
}
_TAGGED_DEPTH = 6
"""How deep a tool call's decoded ``arguments`` sit in what :meth:`PromptLimits.check_chat_body`
measures (the rendered tuple, messages, a message, its tool_calls, a call, its function)."""
_CHAT_ONLY = {"messages", "tools", "tool_choice", "logprobs", "chat_template_kwargs",
              "n", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias",
              "response_format", "modalities"}
_COMPLETION_ONLY = {"prompt", "logprobs", "add_special_tokens", "n", "presence_penalty", "frequency_penalty",
                    "repetition_penalty", "logit_bias", "best_of", "echo", "suffix"}
CHAT_KEYS = frozenset(_COMMON | _CHAT_ONLY)
COMPLETION_KEYS = frozenset(_COMMON | _COMPLETION_ONLY)


@dataclass(frozen=True)
class _Common:
    sampling: dict[str, Any]
    """``SamplingParams`` keys from the request (``logprobs`` excluded: the gateway always asks)."""
    stop: list[str]
    """Text stop strings."""
    stream: bool
    """Answer as server-sent events."""
    include_usage: bool
    """``stream_options.include_usage``: a last chunk with the usage."""
    model: str | None
    """The ``model`` the client named (echoed back)."""


@dataclass(frozen=True)
class ChatRequest(_Common):
    """A checked ``/v1/chat/completions`` body."""

    messages: list[dict[str, Any]] = field(default_factory=list)
    """Messages ready for a chat template: text content (or text and ``image_url`` parts, which the
    gateway decodes before rendering), JSON-decoded tool call arguments."""
    tools: list[dict[str, Any]] | None = None
    """OpenAI tool schemas, or None."""
    parse_tool_calls: bool = False
    """Whether to parse the output into ``tool_calls`` (tools given, ``tool_choice`` not ``none``)."""
    logprobs: bool = False
    """Return OpenAI-shaped ``logprobs`` in the choice."""
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    """Extra template variables."""
    num_images: int = 0
    """Image parts in ``messages`` (``{"type": "image_url", "image_url": {"url"}}``)."""


@dataclass(frozen=True)
class CompletionRequest(_Common):
    """A checked ``/v1/completions`` body."""

    prompt: str | list[int] = ""
    """The prompt, as text or token ids."""
    logprobs: int | None = None
    """Return completions-shaped ``logprobs`` (top lists are not computed)."""
    add_special_tokens: bool = True
    """Whether encoding a text prompt adds the tokenizer's special tokens (BOS), as vLLM does."""


def _check_keys(body: Any, allowed: frozenset[str], endpoint: str) -> None:
    check_known_keys(body, allowed, endpoint)
    check_text(body, endpoint)
    for key, (neutral, value, why) in _NEUTRAL.items():
        if key in allowed and body.get(key) is not None and not neutral(body[key]):
            raise ValueError(f"{key}={_brief(body[key])} is not supported by the agentloop gateway ({why}); "
                             f"leave it out or send {key}={value}")
    top = body.get("top_logprobs")  # ignored, but still a number: a string here is a client's bug
    if top is not None and (isinstance(top, bool) or not isinstance(top, int) or top < 0):
        raise ValueError(f"'top_logprobs' must be a non-negative integer, got {_brief(top)}")


def _common(body: Mapping[str, Any]) -> dict[str, Any]:
    sampling = {k: body[k] for k in _SAMPLING if body.get(k) is not None}
    if "max_completion_tokens" in sampling:
        # The newer name wins, as in OpenAI's API where max_tokens is deprecated.
        sampling["max_tokens"] = sampling.pop("max_completion_tokens")
    SamplingParams.from_mapping(sampling)  # a bad type or range is a 400 naming the key, before any render
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise ValueError(f"'stream' must be true or false, got {_brief(stream)}")
    options = body.get("stream_options") or {}
    if not isinstance(options, Mapping):
        raise ValueError(f"'stream_options' must be an object, got {_brief(options)}")
    include_usage = options.get("include_usage")
    if include_usage is not None and not isinstance(include_usage, bool):
        raise ValueError(f"'stream_options.include_usage' must be true or false, got {_brief(include_usage)}")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise ValueError(f"'model' must be a string, got {_brief(model)}")
    return {"sampling": sampling, "stop": normalize_stop(body.get("stop")), "stream": bool(stream),
            "include_usage": bool(include_usage), "model": model}


def parse_chat_request(body: Any, limits: PromptLimits | None = None) -> ChatRequest:
    """Check a chat completions body.

    Args:
        body: The decoded JSON body.
        limits: No template text, the allowed template variables and the size limits
            (see :class:`~agentloop_engines.serving.gateway.prompt_limits.PromptLimits`); None: the defaults.

    Raises:
        ValueError: naming the unsupported key or the malformed message.
        PromptLimitError: over one of ``limits``' sizes.
    """
    limits = limits or PromptLimits()
    limits.check_chat_body(body)
    _check_keys(body, CHAT_KEYS, "/v1/chat/completions")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ValueError("'messages' must be a non-empty list of chat messages")
    tools = body.get("tools") or None
    if tools is not None:
        if not isinstance(tools, list):
            raise ValueError(f"'tools' must be a list of tool objects, got {type(tools).__name__}")
        for i, tool in enumerate(tools):
            function = tool.get("function") if isinstance(tool, Mapping) else None
            if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
                raise ValueError(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}")
    tool_choice = body.get("tool_choice")
    if tool_choice not in (None, "auto", "none"):
        raise ValueError(f"tool_choice={tool_choice!r} cannot be enforced: the gateway does not constrain "
                         "decoding, so the model may or may not call a tool; use 'auto' (or 'none')")
    kwargs = body.get("chat_template_kwargs") or {}  # checked by limits.check_chat_body
    logprobs = body.get("logprobs")
    if logprobs is not None and not isinstance(logprobs, bool):
        raise ValueError(f"'logprobs' must be true or false for chat completions, got {_brief(logprobs)}")
    parsed = [_template_message(m, i, limits) for i, m in enumerate(messages)]
    return ChatRequest(
        **_common(body),
        messages=parsed,
        num_images=count_images(parsed),
        tools=tools,
        parse_tool_calls=tools is not None and tool_choice != "none",
        logprobs=bool(logprobs),
        chat_template_kwargs=dict(kwargs),
    )


def parse_completion_request(body: Any, limits: PromptLimits | None = None) -> CompletionRequest:
    """Check a completions body: ``prompt`` is text, token ids, or a one-element list of either.

    Args:
        body: The decoded JSON body.
        limits: The size limits (stop strings, prompt characters and tokens); None: the defaults.

    Raises:
        ValueError: naming the unsupported key or the malformed prompt.
        PromptLimitError: over one of ``limits``' sizes.
    """
    (limits or PromptLimits()).check_completion_body(body)
    _check_keys(body, COMPLETION_KEYS, "/v1/completions")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, list):
        if not prompt or not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            raise ValueError("'prompt' must be text, a non-empty list of token ids, or a list holding one of "
                             "them; batches of prompts are not supported: send one request per prompt")
    elif not isinstance(prompt, str) or not prompt:
        raise ValueError(f"'prompt' must be non-empty text or a list of token ids, got {_brief(prompt)}")
    logprobs = body.get("logprobs")
    if logprobs is not None and (isinstance(logprobs, bool) or not isinstance(logprobs, int) or logprobs < 0):
        raise ValueError(f"'logprobs' must be a non-negative integer for completions, got {_brief(logprobs)}")
    add_special = body.get("add_special_tokens", True)
    if not isinstance(add_special, bool):
        raise ValueError(f"'add_special_tokens' must be true or false, got {_brief(add_special)}")
    return CompletionRequest(**_common(body), prompt=prompt, logprobs=logprobs, add_special_tokens=add_special)


def _content(content: Any, where: str, role: str) -> str | list[dict[str, Any]]:
    """Text, or with image parts the text and image parts in order (see :func:`content_parts`)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = content_parts(content, where, role)
        # Text parts alone are joined, as before images were accepted, so text prompts do not change.
        return parts if parts is not None else "\n".join(part["text"] for part in content)
    raise ValueError(f"{where}.content must be text, null or a list of text and image parts, got "
                     f"{type(content).__name__}")


def _template_message(message: Any, index: int, limits: PromptLimits) -> dict[str, Any]:
    where = f"messages[{index}]"
    if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
        raise ValueError(f"{where} must be an object with a 'role'")
    # Clients send absent fields as null (name, refusal, audio); templates test for presence.
    out = {k: v for k, v in message.items() if v is not None}
    if out["role"] == "developer":  # OpenAI's newer name for system; chat templates know system
        out["role"] = "system"
    out["content"] = _content(message.get("content"), where, out["role"])
    calls = message.get("tool_calls")
    if calls:
        if not isinstance(calls, list):
            raise ValueError(f"{where}.tool_calls must be a list")
        out["tool_calls"] = [_template_call(call, f"{where}.tool_calls[{j}]", limits)
                             for j, call in enumerate(calls)]
    return out


def _template_call(call: Any, where: str, limits: PromptLimits) -> dict[str, Any]:
    function = call.get("function") if isinstance(call, Mapping) else None
    if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
        raise ValueError(f"{where} must be {{\"type\": \"function\", \"function\": {{\"name\", \"arguments\"}}}}")
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        # OpenAI sends arguments as a JSON string; templates that iterate them (Qwen3's
        # `arguments|items`, Llama's tojson of a dict) need the object. Invalid JSON stays text.
        try:
            decoded = json.loads(arguments) if arguments.strip() else {}
        except RecursionError:  # the C decoder's way of saying "nested too deep"
            raise limits.depth_error() from None
        except ValueError:
            decoded = None
        if isinstance(decoded, dict):
            limits.json_size(decoded, _TAGGED_DEPTH)  # its size is the string's, counted; its depth is new
            arguments = decoded
    out = {k: v for k, v in call.items() if v is not None}
    out["function"] = {**{k: v for k, v in function.items() if v is not None}, "arguments": arguments}
    out.setdefault("type", "function")
    return out
