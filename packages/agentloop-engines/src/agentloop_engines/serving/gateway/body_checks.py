"""Checks every API's request translation shares: the body's keys and its ``tools`` list.

The Chat Completions, Responses and Messages bodies are checked by their own modules
(:mod:`~agentloop_engines.serving.gateway.openai_request`,
:mod:`~agentloop_engines.serving.gateway.responses_request`,
:mod:`~agentloop_engines.serving.gateway.messages_request`); what they refuse alike is refused here, in
the same words.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from typing import Any

from agentloop_core.parsers.base import holds_non_text, not_text
from agentloop_core.protocol import brief_repr

__all__ = ["check_known_keys", "check_text", "translate_tools"]


def check_known_keys(body: Any, allowed: Collection[str], endpoint: str, *, ignore: Collection[str] = ()) -> None:
    """Check that ``body`` is a JSON object whose keys are all ``allowed`` (or in ``ignore``:
    keys the caller refuses itself, with a reason).

    Raises:
        ValueError: naming the first ten unknown keys and the supported ones.
    """
    if not isinstance(body, Mapping):
        raise ValueError(f"{endpoint} expects a JSON object, got {type(body).__name__}")
    unknown = [str(k) for k in body if k not in allowed and k not in ignore]
    if unknown:
        more = f" and {len(unknown) - 10} more" if len(unknown) > 10 else ""
        raise ValueError(f"unsupported request key(s) {[k[:80] for k in unknown[:10]]}{more} for {endpoint}; "
                         f"supported: {sorted(allowed)}")


def translate_tools(tools: Any, translate: Callable[[Any, str], dict[str, Any]]) -> list[dict[str, Any]]:
    """A request's ``tools`` as chat tools: ``translate(tool, "tools[i]")`` of each (which checks
    the tool, naming it by that path); none when absent.

    Raises:
        ValueError: when ``tools`` is not a list, or what ``translate`` raises.
    """
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise ValueError(f"'tools' must be a list of tool objects, got {brief_repr(tools)}")
    return [translate(tool, f"tools[{i}]") for i, tool in enumerate(tools)]


def check_text(body: Any, endpoint: str) -> None:
    """Refuse a body with a string (or object key) that is not Unicode text: a lone UTF-16
    surrogate such as ``"\\ud800"`` is valid JSON, but no tokenizer encodes it and no answer
    (which may echo it) can be sent, so it is refused before anything is rendered or generated.
    One walk of the body (a loop, not recursion: the nesting is the client's choice); a second
    one names where, only when there is something to name.

    Raises:
        ValueError: naming the string's place in the body and how to fix it.
    """
    if not holds_non_text(body):
        return
    where = brief_repr(_place(body) or "the body")[1:-1]  # a path as deep as the body: shortened
    raise ValueError(f"{endpoint}: {where} holds a lone UTF-16 surrogate (such as \"\\ud800\"), which is not "
                     "Unicode text: no tokenizer encodes it and no answer can carry it back; send valid text "
                     "(replace the unpaired surrogate, e.g. with U+FFFD)")


def _place(body: Any) -> str | None:
    """The path (``messages[2].content``) of the first string in ``body`` that is not text."""
    stack: list[tuple[Any, str]] = [(body, "")]
    while stack:
        item, path = stack.pop()
        if isinstance(item, str):
            if not_text(item):
                return path
        elif isinstance(item, Mapping):
            for key, value in reversed(list(item.items())):
                name = f"{path}.{key}" if path else str(key)
                if isinstance(key, str) and not_text(key):
                    return f"a key of {path or 'the body'}"
                stack.append((value, name if isinstance(key, str) else f"{path}[{key!r}]"))
        elif isinstance(item, (list, tuple)):
            stack.extend((value, f"{path}[{i}]") for i, value in reversed(list(enumerate(item))))
    return None
