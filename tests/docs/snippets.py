"""Code blocks of the documentation pages, and the markers that say how the tests run them.

A fenced ``bash``, ``sh`` or ``python`` block runs as written. An HTML comment on the line
just before a block (invisible on the rendered page) changes that:

- ``<!-- snippet: skip reason="..." -->``: not run; the reason is listed in the test output.
- ``<!-- snippet: run-with KEY=VALUE ... -->``: the overrides are appended to every
  ``agentloop train`` command of the block (a long training run made short).
- ``<!-- snippet: file PATH -->``: the block (any language) is written to ``PATH`` in the page's
  folder before the page's later blocks run, instead of being run itself.

An unknown marker is an error, so a typo cannot turn a check off.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

RUN_LANGS = ("bash", "sh", "python")
"""Languages of the blocks the tests run."""

_FENCE = re.compile(r"^(?P<indent>[ ]*)```(?P<lang>[\w+-]*)[^\n]*\n(?P<body>.*?)^(?P=indent)```[ ]*$",
                    re.MULTILINE | re.DOTALL)
_MARKER = re.compile(r"<!--\s*snippet:\s*(?P<kind>[\w-]+)\s*(?P<arg>.*?)\s*-->\s*$")
_TRAIN = re.compile(r"^(?P<cmd>[ \t]*agentloop (?:train|eval)\b[^#\n]*?)(?P<comment>[ \t]+#.*)?$", re.MULTILINE)


class SnippetMarkerError(ValueError):
    """A marker the tests do not know, or one missing its argument."""


@dataclass(frozen=True)
class Snippet:
    """One fenced block of a page, with what its marker says."""

    page: Path
    line: int
    lang: str
    body: str
    kind: str = "run"
    """``run``, ``skip`` or ``file``."""
    arg: str = ""
    """The skip reason, the overrides of ``run-with``, or the file's path."""

    @property
    def id(self) -> str:
        """``page.md:LINE``, the test id."""
        return f"{self.page.name}:{self.line}"

    def command(self) -> str:
        """The block as it runs: continuation lines joined and, for ``run-with``, the overrides
        appended to each ``agentloop train``."""
        if self.kind != "run-with":
            return self.body
        text = self.body.replace("\\\n", " ")
        return _TRAIN.sub(lambda m: f"{m['cmd']} {self.arg}{m['comment'] or ''}", text)


def _marker(text: str, start: int) -> tuple[str, str]:
    before = text[:start].rstrip("\n").rsplit("\n", 1)[-1].strip()
    if not before.startswith("<!--") or "snippet:" not in before:
        return "run", ""
    m = _MARKER.fullmatch(before)
    if not m:
        raise SnippetMarkerError(f"malformed snippet marker {before!r}")
    kind, arg = m["kind"], m["arg"]
    if kind == "skip":
        reason = re.fullmatch(r'reason="(.+)"', arg)
        if not reason:
            raise SnippetMarkerError(f'skip needs reason="...": {before!r}')
        return kind, reason[1]
    if kind in ("run-with", "file"):
        if not arg:
            raise SnippetMarkerError(f"{kind} needs an argument: {before!r}")
        if kind == "file" and (len(shlex.split(arg)) != 1 or Path(arg).is_absolute() or ".." in Path(arg).parts):
            raise SnippetMarkerError(f"file needs one relative path inside the page's folder: {before!r}")
        return kind, arg
    raise SnippetMarkerError(f"unknown snippet marker {kind!r} (skip, run-with, file): {before!r}")


def page_snippets(page: Path) -> list[Snippet]:
    """Every fenced block of ``page`` that runs, is skipped or is written as a file, in order."""
    text = page.read_text(encoding="utf-8")
    out = []
    for m in _FENCE.finditer(text):
        kind, arg = _marker(text, m.start())
        lang = m["lang"].lower()
        if kind != "file" and lang not in RUN_LANGS:
            continue
        body = "\n".join(line[len(m["indent"]):] for line in m["body"].splitlines()) + "\n"
        out.append(Snippet(page, text.count("\n", 0, m.start()) + 1, lang, body, kind, arg))
    return out
