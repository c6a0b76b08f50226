"""LangChain messages as chat-template dicts, and how a model call's history is checked against
the tokens already recorded for its trajectory.

The check is what keeps the one law: a LangGraph graph may hand the model any list of messages
(trimmed, summarised, edited), but one training sequence can only hold turns that each extend
the earlier tokens. So a call extends the trajectory only when it sees exactly the recorded
messages, in order, plus new non-assistant messages; anything else is a
:class:`HistoryRewrittenError`, on which :class:`~agentloop_langgraph.ChatModel` starts a new
segment (or, with ``on_history_rewrite="error"``, lets it fail the sample).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, get_args

from langchain_core.messages import (
    AIMessage,
    BaseMessage,
    ChatMessage,
    HumanMessage,
    SystemMessage,
    ToolMessage,
)

METADATA_KEY = "agentloop"
"""Key of ``AIMessage.response_metadata`` under which :class:`ChatModel` keeps the token ids."""

HistoryRewrite = Literal["segment", "error"]
"""What a model call that does not extend its trajectory does (``on_history_rewrite``):
``segment`` starts a new segment, ``error`` raises :class:`HistoryRewrittenError`."""
HISTORY_REWRITE_CHOICES: tuple[str, ...] = get_args(HistoryRewrite)
""":data:`HistoryRewrite`'s values."""

REWRITE_FIX = ("To train such a graph, let each rewrite start a new segment (on_history_rewrite='segment', "
               "the default), or keep the full message history while training.")
"""How to fix a :class:`HistoryRewrittenError`; appended to it where it is raised."""


class HistoryRewrittenError(RuntimeError):
    """A model call's messages are not the trajectory's recorded messages plus new ones.

    Found when a graph edits, drops or reorders earlier messages (summaries, trimming), edits
    a generated message, or inserts an assistant message the engine did not generate. One
    sequence holding such an episode would need re-encoded text, so
    :class:`~agentloop_langgraph.ChatModel` starts a new segment instead; with
    ``on_history_rewrite="error"`` it raises this and the ``react_agent`` loop fails the sample.
    """


class RolloutLimitReachedError(RuntimeError):
    """The trajectory hit a rollout limit (token budget, assistant turns, the prompt length of a
    new segment) before a model call.

    Not a failure: the loop ends the episode here and trains on the tokens so far.

    Args:
        reason: ``response_length``, ``max_assistant_turns`` or ``prompt_length``.
        message: What happened, for people.
    """

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


SUPPORTED_BLOCKS = (
    "text blocks, and images as {'type': 'image_url', 'image_url': {'url': <data URL>}}, "
    "{'type': 'image', 'base64': ..., 'mime_type': 'image/...'}, {'type': 'image', 'source_type': 'base64', "
    "'data': ..., 'mime_type': ...} or {'type': 'image', 'image': <PIL image or bytes>}")
"""The content blocks :class:`~agentloop_langgraph.ChatModel` renders, named in its errors."""

_IMAGE_BLOCKS = frozenset({"image", "image_url", "input_image"})
_REFUSED_BLOCKS = {
    "audio": "audio", "input_audio": "audio", "file": "file", "input_file": "file",
    "video": "video", "video_url": "video", "input_video": "video",
}


def _refused(message: BaseMessage, index: int, kind: str, why: str) -> ValueError:
    return ValueError(f"{type(message).__name__} content[{index}] is a {kind!r} block: {why}. agentloop's ChatModel "
                      f"renders {SUPPORTED_BLOCKS}; send videos as frames (images) and describe other media in text.")


def _image_source(message: BaseMessage, index: int, block: dict[str, Any]) -> Any:
    """What an image block carries, in a form :func:`agentloop_core.vision.decode_image` reads."""
    if block.get("type") in ("image_url", "input_image"):
        url = block.get("image_url")
        url = url.get("url") if isinstance(url, dict) else url
        if url is None:
            raise _refused(message, index, block["type"], "it has no image_url")
        return url
    if block.get("image") is not None:  # Hugging Face / Qwen parts (and verl's rows)
        return block["image"]
    data = block.get("base64")
    if data is None and block.get("source_type") == "base64":
        data = block.get("data")
    if data is not None:
        return f"data:{block.get('mime_type') or 'image/png'};base64,{data}"
    url = block.get("url")
    if url is None and block.get("source_type") == "url":
        url = block.get("data")
    if url is not None:
        return url
    raise _refused(message, index, "image", "it names no image data (a provider file id cannot be read here)")


def content_parts(message: BaseMessage) -> str | list[dict[str, Any]]:
    """A message's content as chat-template content: its text, or (when it holds an image)
    text parts and ``{"type": "image", "image": <source>}`` parts in order, which the
    trajectory decodes and renders with the model's vision processor.

    Raises:
        ValueError: for audio, file and video blocks and blocks of unknown types, naming what
            is supported.
    """
    content = message.content
    if isinstance(content, str):
        return content
    parts: list[dict[str, Any]] = []
    for i, block in enumerate(content):
        if isinstance(block, str):
            parts.append({"type": "text", "text": block})
            continue
        kind = block.get("type") if isinstance(block, dict) else type(block).__name__
        if kind == "text":
            parts.append({"type": "text", "text": str(block.get("text", ""))})
        elif kind in _IMAGE_BLOCKS:
            parts.append({"type": "image", "image": _image_source(message, i, block)})
        elif kind in _REFUSED_BLOCKS:
            raise _refused(message, i, kind, f"{_REFUSED_BLOCKS[kind]} is not supported")
        else:
            raise _refused(message, i, str(kind), "an unknown content block")
    if not any(p["type"] == "image" for p in parts):
        return "".join(p["text"] for p in parts)
    return parts


def content_text(message: BaseMessage) -> str:
    """The text of a message's content (a string, or a list of text blocks).

    Raises:
        ValueError: for any other block (images included: use :func:`content_parts`).
    """
    content = content_parts(message)
    if isinstance(content, str):
        return content
    raise ValueError(f"{type(message).__name__} holds an image; only user, tool and system messages may hold images "
                     "(the model's own turns are text)")


def to_chat_dict(message: BaseMessage) -> dict[str, Any]:
    """The chat-template dict of a LangChain message that the engine did not generate.

    Tool messages keep ``name`` and ``tool_call_id`` so templates that render them can; an
    assistant message from the prompt (a few-shot example) renders its ``tool_calls`` in the
    OpenAI layout. Images in user, tool and system messages become
    ``{"type": "image", "image": <source>}`` parts (see :func:`content_parts`).

    Raises:
        ValueError: for an unknown message type, an audio/file/video block, or an image in an
            AI message.
    """
    if isinstance(message, AIMessage):
        out: dict[str, Any] = {"role": "assistant", "content": content_text(message)}
        if message.tool_calls:
            out["tool_calls"] = [
                {"type": "function", "id": call.get("id") or "",
                 "function": {"name": call["name"], "arguments": call["args"]}}
                for call in message.tool_calls
            ]
        return out
    content = content_parts(message)
    if isinstance(message, SystemMessage):
        return {"role": "system", "content": content}
    if isinstance(message, HumanMessage):
        return {"role": "user", "content": content}
    if isinstance(message, ToolMessage):
        return {"role": "tool", "name": message.name or "", "tool_call_id": message.tool_call_id, "content": content}
    if isinstance(message, ChatMessage):
        return {"role": message.role, "content": content}
    raise ValueError(
        f"cannot render a {type(message).__name__}; use System/Human/AI/Tool messages or ChatMessage"
    )


def generation_info(message: BaseMessage) -> dict[str, Any] | None:
    """The token record :class:`ChatModel` stored on an AI message it generated, else None."""
    if not isinstance(message, AIMessage):
        return None
    info = message.response_metadata.get(METADATA_KEY)
    return info if isinstance(info, dict) else None


@dataclass(frozen=True)
class Recorded:
    """One message of a trajectory as it was recorded, to compare later calls against."""

    kind: str
    """``prompt`` or ``appended`` (rendered, mask 0) or ``generated`` (engine ids, mask 1)."""
    chat: dict[str, Any] | None = None
    """The chat dict that was rendered (prompt/appended messages)."""
    turn: int = 0
    """Generated messages: 1-based generation index within the trajectory."""
    response_ids: tuple[int, ...] = ()
    """Generated messages: the engine's ids."""
    content: str = ""
    """Generated messages: the AIMessage content the model returned."""
    calls: str = ""
    """Generated messages: the AIMessage tool calls (name, args), canonical JSON."""


def calls_signature(message: AIMessage) -> str:
    """Canonical JSON of an AI message's tool calls (names and arguments, in order)."""
    return json.dumps([[c["name"], c["args"]] for c in message.tool_calls], sort_keys=True, default=str)


def _describe(message: BaseMessage) -> str:
    text = content_text(message) if isinstance(message.content, str) else str(message.content)
    short = text if len(text) <= 60 else text[:57] + "..."
    return f"{type(message).__name__}({short!r})"


def check_extension(
    request_id: str, recorded: Sequence[Recorded], incoming: Sequence[BaseMessage]
) -> list[BaseMessage]:
    """Check that ``incoming`` is ``recorded`` plus new non-assistant messages; return the new ones.

    Args:
        request_id: The trajectory's request id (generated messages must carry it).
        recorded: The trajectory's messages so far.
        incoming: The messages of this model call.

    Returns:
        The new messages (at least one).

    Raises:
        HistoryRewrittenError: naming the first message that differs and why.
    """
    for i, (rec, msg) in enumerate(zip(recorded, incoming, strict=False)):  # incoming may be shorter
        if rec.kind == "generated":
            info = generation_info(msg)
            why = None
            if info is None:
                why = f"expected the AI message generated at turn {rec.turn}, got {_describe(msg)}"
            elif info.get("request_id") != request_id or info.get("turn") != rec.turn:
                why = (f"expected the AI message of request {request_id} turn {rec.turn}, got the one of "
                       f"request {info.get('request_id')} turn {info.get('turn')}")
            elif tuple(info.get("response_ids") or ()) != rec.response_ids:
                why = f"the token ids kept on the AI message of turn {rec.turn} were changed"
            elif content_text(msg) != rec.content or calls_signature(msg) != rec.calls:  # type: ignore[arg-type]
                why = f"the content or tool calls of the AI message of turn {rec.turn} were edited"
            if why is not None:
                raise HistoryRewrittenError(f"request {request_id}: message {i}: {why}")
            continue
        try:
            chat = to_chat_dict(msg)
        except ValueError as exc:
            raise HistoryRewrittenError(f"request {request_id}: message {i}: {exc}") from None
        if chat != rec.chat:
            raise HistoryRewrittenError(
                f"request {request_id}: message {i} differs from the recorded one: recorded "
                f"{rec.chat!r}, got {chat!r}")
    if len(incoming) <= len(recorded):
        raise HistoryRewrittenError(
            f"request {request_id}: the model was called with {len(incoming)} messages but the trajectory "
            f"already holds {len(recorded)}; a call must add at least one new message after the last "
            f"model turn (the graph dropped or trimmed messages, or called the model twice in a row)")
    new = list(incoming[len(recorded):])
    for j, msg in enumerate(new, start=len(recorded)):
        if isinstance(msg, AIMessage):
            raise HistoryRewrittenError(
                f"request {request_id}: message {j} is an AI message the engine did not generate for this "
                f"trajectory ({_describe(msg)}); only tool, user and system messages may be added between "
                f"model turns, since training needs the engine's own tokens for every assistant turn.")
    return new


__all__ = [
    "HISTORY_REWRITE_CHOICES",
    "METADATA_KEY",
    "REWRITE_FIX",
    "HistoryRewrite",
    "HistoryRewrittenError",
    "Recorded",
    "RolloutLimitReachedError",
    "SUPPORTED_BLOCKS",
    "calls_signature",
    "check_extension",
    "content_parts",
    "content_text",
    "generation_info",
    "to_chat_dict",
]

