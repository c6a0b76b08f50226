"""Token-exact sessions: a chat call that only appends messages continues the previous call's ids.

A black-box agent sends its whole history back on every call, with the assistant replies as the
text the gateway returned. Rendering that text again and encoding it does not give back the ids
the engine generated when they were not the canonical tokenization of their text (sampling often
writes a word in pieces), when decoding dropped special tokens, or when the engine stopped
without the template's end-of-turn token. The prompt would then not start with the previous
prompt + the generated ids, and training would split the trajectory into segments although the
agent edited nothing.

So within a session the gateway keeps, per session, the previous chat call as a core
:class:`~agentloop_core.tokenization.Trajectory` (its prompt ids and the engine's ids verbatim)
together with the messages that call was sent and the assistant message it returned. When the
next request's messages are exactly those messages + that assistant message + new
non-assistant messages (tool results, user turns, system), its prompt is the previous prompt +
the generated ids + the template's delta for the new messages (and the generation prompt), as
:meth:`Trajectory.append_messages` computes it. Anything else (the agent trimmed, summarised or
rewrote its history, sent another reply than the one returned, changed ``tools`` or
``chat_template_kwargs``) is rendered whole, as a call outside a session is, and the session
continues from that call.

Images take part like any other content: a resent image compares by a digest of its URL, the
image tokens of earlier turns are in the previous call's ids already, and the delta expands only
the new messages' images, so a conversation with images continues (and records as one segment)
as a text one does; the call's images are the trajectory's, in the order of their tokens.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from agentloop_core.tokenization import Trajectory
from agentloop_core.vision import ImageItem
from agentloop_engines.serving.gateway.images import digested

__all__ = ["ChatState", "ContinuationPlan", "extension", "normalize_message", "renderer_key"]

# Keys OpenAI SDKs add to an assistant message they send back (from the response object), which
# the gateway never returns a value for and which do not change what the engine generated.
_IGNORED_KEYS = frozenset({"refusal", "audio", "annotations", "function_call", "type"})


def renderer_key(tools: Sequence[Mapping[str, Any]] | None, template_kwargs: Mapping[str, Any]) -> tuple[str, str]:
    """What a render depends on besides the messages: the tools and the template variables."""
    return (json.dumps(tools or None, sort_keys=True, default=str),
            json.dumps(dict(template_kwargs), sort_keys=True, default=str))


def _arguments(arguments: Any) -> Any:
    """Tool call arguments as parsed JSON (OpenAI sends a JSON string; the request parser has
    already decoded valid JSON to an object), so formatting differences do not count."""
    if isinstance(arguments, str):
        try:
            return json.loads(arguments) if arguments.strip() else {}
        except ValueError:
            return arguments
    return arguments


def normalize_message(message: Mapping[str, Any]) -> str:
    """A comparable form of a chat message (as :func:`parse_chat_request` leaves it, or as the
    gateway returned it).

    Assistant messages compare by content (None is ``""``) and tool calls (id, function name,
    arguments as parsed JSON): what the engine generated and the ids the gateway gave its calls.
    Other messages compare by every key that has a value, except keys SDKs add to messages they
    send back (``refusal``, ``audio``, ``annotations``, ``function_call``); an image by a digest
    of its URL, so the state a session keeps holds no image payload.
    """
    role = message.get("role")
    if role == "assistant":
        calls = []
        for call in message.get("tool_calls") or ():
            function = call.get("function") if isinstance(call, Mapping) else None
            function = function if isinstance(function, Mapping) else {}
            calls.append([call.get("id") if isinstance(call, Mapping) else None, function.get("name"),
                          _arguments(function.get("arguments"))])
        return json.dumps({"role": role, "content": message.get("content") or "", "tool_calls": calls},
                          sort_keys=True, default=str)
    kept = {k: v for k, v in message.items() if v is not None and k not in _IGNORED_KEYS}
    kept["content"] = message.get("content") or ""
    if isinstance(kept["content"], list):
        kept = digested([kept])[0]
    return json.dumps(kept, sort_keys=True, default=str)


@dataclass(frozen=True)
class ChatState:
    """A session's last chat call, as the next call may continue it."""

    key: tuple[str, str]
    """:func:`renderer_key` of its tools and template variables."""
    trajectory: Trajectory | None
    """Its prompt and generated ids (the generated turn last); None when the chat template
    cannot be split into turns, so no call can continue it."""
    expected: tuple[str, ...]
    """The normalized messages a continuing request starts with: the call's request messages
    and the assistant message it returned."""


@dataclass(frozen=True)
class ContinuationPlan:
    """How one session chat call got its prompt."""

    prompt_ids: list[int]
    """The ids sent to the engine."""
    key: tuple[str, str]
    """:func:`renderer_key` of the request."""
    base: ChatState | None = None
    """The state this call continues (its prompt extends that call's ids), or None."""
    new_messages: list[dict[str, Any]] | None = None
    """With ``base``: the messages appended after its returned assistant message."""
    trajectory: Trajectory | None = None
    """Without ``base``: a trajectory of the whole request rendered, or None when the template
    cannot be split into turns."""
    had_previous: bool = False
    """The session had a chat call before this one."""
    images: tuple[ImageItem, ...] = ()
    """The images of ``prompt_ids``, in the order of their tokens."""

    @property
    def extends_previous(self) -> bool:
        """The prompt is the previous chat call's prompt + generated ids + a delta."""
        return self.base is not None


def extension(state: ChatState, key: tuple[str, str], messages: Sequence[Mapping[str, Any]]) -> list[dict] | None:
    """The messages ``messages`` add after ``state``'s call and reply, when they only append
    messages other than assistant turns (and the tools and template variables are the same);
    None otherwise."""
    if state.trajectory is None or state.key != key:
        return None
    n = len(state.expected)
    if len(messages) <= n:
        return None
    new = [dict(m) for m in messages[n:]]
    if any(m.get("role") == "assistant" for m in new):
        return None
    if tuple(normalize_message(m) for m in messages[:n]) != state.expected:
        return None
    return new
