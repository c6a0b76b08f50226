"""Text from models, tools and model files, made safe to print on a terminal.

The policy under optimisation writes whatever raises its reward, and a tool or an MCP server
answers whatever it likes; either can hold escape sequences that a terminal obeys: ``ESC]0;``
retitles the window, ``ESC[2J`` clears the screen, ``\\r`` or cursor moves overwrite a status line
with a forged one, and bidi overrides (U+202E) make a line read other than its bytes. Every place
the CLI prints or logs such text passes it through :func:`console_safe`, which shows those
characters as visible escapes (``\\x1b``, ``\\u202e``) and keeps ``\\n`` and ``\\t``. Logging in
the ``agentloop`` command goes through :class:`ConsoleSafeFormatter`
(:func:`install_console_logging`), so a ``logger.warning`` quoting a tool's error is escaped too.

Opt-out: ``AGENTLOOP_CONSOLE_RAW=1`` prints such text as it is (for a trusted model whose
output colours the terminal on purpose).
"""

from __future__ import annotations

import logging
import os
import re
import sys

RAW_ENV = "AGENTLOOP_CONSOLE_RAW"
"""Set to ``1`` to print model and tool text unescaped."""

_UNSAFE = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")
"""C0 controls but ``\\t`` and ``\\n``, DEL, C1 controls (``\\x9b`` is a one-byte CSI), and the
bidi embeddings, overrides and isolates."""


def _visible(match: re.Match[str]) -> str:
    code = ord(match.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def console_safe(text: object) -> str:
    """``text`` (``str()`` of it when it is not a string) with every character a terminal would
    obey shown as a visible escape; ``\\n`` and ``\\t`` are kept. Unchanged when
    ``AGENTLOOP_CONSOLE_RAW=1``."""
    s = text if isinstance(text, str) else str(text)
    if os.environ.get(RAW_ENV) == "1":
        return s
    return _UNSAFE.sub(_visible, s)


class ConsoleSafeFormatter(logging.Formatter):
    """A :class:`logging.Formatter` whose output (message, arguments and traceback) is
    :func:`console_safe`."""

    def format(self, record: logging.LogRecord) -> str:
        return console_safe(super().format(record))


def install_console_logging(level: int = logging.WARNING) -> None:
    """Give the root logger an escaping stderr handler, as Python's last-resort handler would
    print (``%(message)s``, WARNING and up), unless logging is configured already (by the user,
    or by a test harness)."""
    root = logging.getLogger()
    if root.handlers:
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(ConsoleSafeFormatter("%(message)s"))
    handler.setLevel(level)
    root.addHandler(handler)


__all__ = ["RAW_ENV", "ConsoleSafeFormatter", "console_safe", "install_console_logging"]
