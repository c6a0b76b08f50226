"""Tool-aware chat templates shipped with agentloop, by name, for checkpoints whose own template
ignores ``tools=`` (SmolLM2's plain ChatML, Llama 3.0's, Gemma's) or that have none (the GGUF of
gemma-3-270m): the model would never see the tool schemas, so every tool-using trajectory would be
wasted.

A template is chosen by configuration (the trainer's ``model.custom_chat_template``,
``agentloop serve --chat-template``), never by model name: :func:`resolve_chat_template` takes a
built-in name, a path to a Jinja file, or the template text itself (verl's
``custom_chat_template`` holds the text), and returns the Jinja text to set as
``tokenizer.chat_template`` or to pass as ``ChatRenderer(chat_template=...)``.

Each built-in is written for one of core's tool parsers (:mod:`agentloop_core.parsers`): what the
template renders for an assistant turn's ``tool_calls`` is what that parser reads back.
"""

from __future__ import annotations

import difflib
import functools
import os
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

__all__ = [
    "BuiltinChatTemplate",
    "builtin_chat_template",
    "chat_template_names",
    "describe_chat_templates",
    "resolve_chat_template",
    "set_chat_template",
]


@dataclass(frozen=True)
class BuiltinChatTemplate:
    """One built-in template."""

    name: str
    """What configs call it (``model.custom_chat_template=<name>``)."""
    file: str
    """Its file in ``agentloop_core/tokenization/templates/``."""
    tool_parser: str
    """The core tool parser that reads the calls it renders (``multi_turn.tool_parser``)."""
    summary: str
    """One line: the turn layout and where tools, calls and results go."""


BUILTINS: dict[str, BuiltinChatTemplate] = {
    t.name: t
    for t in (
        BuiltinChatTemplate(
            "chatml-hermes", "chatml-hermes.jinja", "hermes",
            "ChatML turns; tools in the system turn inside <tools></tools>; calls as <tool_call> JSON blocks; "
            "results as <tool_response> blocks in a user turn",
        ),
        BuiltinChatTemplate(
            "gemma-hermes", "gemma-hermes.jinja", "hermes",
            "Gemma turns (<start_of_turn>user|model, <end_of_turn>) after BOS; system text and tools (inside "
            "<tools></tools>) folded into the first user turn; calls as <tool_call> JSON blocks; results as "
            "<tool_response> blocks in a user turn",
        ),
        BuiltinChatTemplate(
            "llama3-json", "llama3-json.jinja", "llama3_json",
            "Llama 3 header turns (<|start_header_id|>role<|end_header_id|>, <|eot_id|>); tools in the system "
            "turn; a calling turn is the JSON call objects joined by '; '; results in ipython turns",
        ),
    )
}
"""The built-in templates by name."""


def chat_template_names() -> tuple[str, ...]:
    """The names of the built-in chat templates, sorted."""
    return tuple(sorted(BUILTINS))


def describe_chat_templates() -> str:
    """One line per built-in: its name, the tool parser it pairs with, and its layout."""
    return "\n".join(f"{t.name} (tool parser {t.tool_parser}): {t.summary}" for t in sorted(BUILTINS.values(),
                                                                                           key=lambda t: t.name))


@functools.cache
def builtin_chat_template(name: str) -> str:
    """The Jinja text of the built-in template ``name``.

    Raises:
        ValueError: for an unknown name, listing the built-ins.
    """
    if name not in BUILTINS:
        raise ValueError(_unknown(name))
    return resources.files("agentloop_core.tokenization").joinpath("templates", BUILTINS[name].file).read_text(
        encoding="utf-8")


def _looks_like_jinja(text: str) -> bool:
    return "{{" in text or "{%" in text


def resolve_chat_template(value: str | os.PathLike[str]) -> str:
    """The Jinja text ``value`` names.

    Args:
        value: A built-in name (:func:`chat_template_names`), a path to a Jinja file, or the
            template text itself (anything with ``{{`` or ``{%`` in it, as verl's
            ``custom_chat_template`` holds it).

    Returns:
        The template text.

    Raises:
        ValueError: when ``value`` is none of these; the message lists the built-in names and
            says that a path works too.
        TypeError: when ``value`` is not text or a path.
    """
    if not isinstance(value, (str, os.PathLike)):
        raise TypeError(f"a chat template is a built-in name, a path or Jinja text, not {type(value).__name__}")
    text = os.fspath(value)
    if isinstance(value, str):
        if _looks_like_jinja(text):
            return text
        if text in BUILTINS:
            return builtin_chat_template(text)
    path = Path(text).expanduser()
    if path.is_file():
        return path.read_text(encoding="utf-8")
    if path.exists():
        raise ValueError(f"chat template {text!r} is a folder, not a Jinja file; give the .jinja file's path")
    raise ValueError(_unknown(text))


def _unknown(name: str) -> str:
    close = difflib.get_close_matches(name, list(BUILTINS), n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return (f"unknown chat template {name!r}{hint}: not a built-in name ({', '.join(chat_template_names())}) nor "
            "an existing file; give a built-in name, a path to a Jinja file, or the template text")


def set_chat_template(tokenizer: Any, value: str | os.PathLike[str] | None) -> Any:
    """Make ``value``'s template (see :func:`resolve_chat_template`) ``tokenizer``'s own, so every
    render from it (loops, the gateway, ``save_pretrained`` of an exported checkpoint) uses it.

    A processor's inner ``.tokenizer`` gets it too, so either saves the same template.

    Args:
        tokenizer: A Hugging Face tokenizer or processor (changed in place).
        value: The template; None or empty: leave the tokenizer's own.

    Returns:
        ``tokenizer``.
    """
    if value is None or value == "":
        return tokenizer
    text = resolve_chat_template(value)
    tokenizer.chat_template = text
    inner = getattr(tokenizer, "tokenizer", None)
    if inner is not None and inner is not tokenizer and hasattr(inner, "chat_template"):
        inner.chat_template = text
    return tokenizer
