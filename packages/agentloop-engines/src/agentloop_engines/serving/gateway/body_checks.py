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

from agentloop_core.protocol import brief_repr

__all__ = ["check_known_keys", "translate_tools"]


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
