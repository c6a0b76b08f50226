"""Failures of the chat template itself, told apart from bugs in the code that calls it.

A template fails in two ways: it refuses a conversation on purpose (``raise_exception(...)``,
e.g. Llama 3.1 on parallel tool calls, Mistral on tool call ids that are not 9 characters), or
it crashes in Jinja (a tool_use template that iterates ``tools`` when none were given raises
``TypeError: 'NoneType' object is not iterable``). Both are told by the traceback: Jinja
rewrites the frames of template code so they carry ``__jinja_exception__`` in their globals, and
transformers' ``raise_exception`` raises a plain ``jinja2.TemplateError`` from a function of
that name. A ``TypeError`` raised by our own code has no template frame and is left alone.
"""

from __future__ import annotations

import traceback
from types import FrameType


class ChatTemplateError(ValueError):
    """The chat template cannot render a minimal conversation with the renderer's tools and
    variables, so no trajectory can be built with it."""

    def __init__(self, message: str, *, refusal: str | None = None) -> None:
        super().__init__(message)
        self.refusal = refusal
        """The template's own ``raise_exception`` message, or None when it crashed instead."""


def _frames(exc: BaseException) -> list[tuple[FrameType, int]]:
    return list(traceback.walk_tb(exc.__traceback__))


def template_line(exc: BaseException) -> int | None:
    """The line of template code ``exc`` was raised at (innermost), or None when it was not
    raised while a template ran."""
    lines = [lineno for frame, lineno in _frames(exc) if "__jinja_exception__" in frame.f_globals]
    return lines[-1] if lines else None


def raised_by_template(exc: BaseException) -> bool:
    """Whether ``exc`` was raised while a Jinja template ran (its own code, a filter it called,
    ``raise_exception``), or by Jinja compiling one."""
    from jinja2 import TemplateError

    return isinstance(exc, TemplateError) or template_line(exc) is not None


def template_refusal(exc: BaseException) -> str | None:
    """The message of a template's own ``raise_exception(...)`` found in ``exc`` or the
    exceptions it was raised from; None for any other failure (a template crash, our bugs)."""
    from jinja2 import TemplateError

    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        frames = _frames(current)
        if isinstance(current, TemplateError) and frames and frames[-1][0].f_code.co_name == "raise_exception":
            return str(current)
        current = current.__cause__
    return None
