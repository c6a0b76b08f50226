"""The config reference page, generated from the typed trainer config at build time.

Every leaf of :class:`~agentloop_trainer.config.TrainConfig` is listed under its section with
its default, its docstring and the verl spellings ``agentloop train`` reads as it
(:mod:`agentloop_trainer.config.verl_compat`), so a key added to a section appears on the page
without anyone writing it. Used as an mkdocs hook (``hooks:`` in mkdocs.yml: :func:`on_files`
adds ``reference/config.md``) and by ``tests/docs/test_config_reference.py``.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import json
import re
import textwrap
from typing import Any

PAGE = "reference/config.md"
"""Where the generated page lives in the site (a path under ``docs/``; no file is written)."""

_ROLE = re.compile(r":(?:class|func|data|mod|meth|attr|obj):`~?([^`]+)`")


def field_docs(cls: type) -> dict[str, str]:
    """The attribute docstrings of a dataclass (the string literal after each field), by name,
    its bases' included (a subclass's own win)."""
    docs: dict[str, str] = {}
    for klass in reversed([k for k in cls.__mro__ if dataclasses.is_dataclass(k)]):
        tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
        for stmt, nxt in zip(body, [*body[1:], None], strict=True):
            if (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)
                    and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
                    and isinstance(nxt.value.value, str)):
                docs[stmt.target.id] = inspect.cleandoc(nxt.value.value)
    for f in dataclasses.fields(cls):
        # A generated field (the trainer's multi_turn keys) is documented where it is declared.
        source = f.metadata.get("doc_from")
        if f.name not in docs and source is not None:
            docs[f.name] = field_docs(source).get(f.name, "")
    return docs


def format_default(value: Any) -> str:
    """A default as it is written in YAML or on the command line (``null``, ``true``, ``1e-05``)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return value if value else '""'
    if isinstance(value, (dict, list)):
        return json.dumps(value)
    return repr(value)


def _prose(text: str) -> str:
    """Docstring text as Markdown: Sphinx roles become code spans, lines are joined."""
    return " ".join(_ROLE.sub(r"`\1`", text).split())


def verl_spellings() -> dict[str, list[str]]:
    """agentloop key -> the verl keys read as it (renamed, or one verl key split into several)."""
    from agentloop_trainer.config import verl_compat

    out: dict[str, list[str]] = {}
    for verl_key, key in verl_compat.RENAMED.items():
        out.setdefault(key, []).append(verl_key)
    for verl_key, keys in verl_compat.SPLIT.items():
        for key in keys:
            out.setdefault(key, []).append(verl_key)
    return out


@dataclasses.dataclass
class Entry:
    """One documented key: its dotted name, default (as written), doc and verl spellings."""

    key: str
    default: str
    doc: str
    verl: list[str]


@dataclasses.dataclass
class Section:
    """A config section: its dotted name, its record's docstring and its leaf keys."""

    name: str
    doc: str
    entries: list[Entry]


def sections() -> list[Section]:
    """Every section of the config, depth first in declaration order, with its leaf keys."""
    from agentloop_trainer.config import TrainConfig

    verl = verl_spellings()
    out: list[Section] = []

    def walk(record: Any, prefix: str) -> None:
        cls = type(record)
        docs = field_docs(cls)
        section = Section(prefix.rstrip("."), _prose(inspect.getdoc(cls) or ""), [])
        out.append(section)
        nested = []
        for f in dataclasses.fields(record):
            value = getattr(record, f.name)
            if dataclasses.is_dataclass(value):
                nested.append((value, f"{prefix}{f.name}."))
                continue
            key = f"{prefix}{f.name}"
            section.entries.append(Entry(key, format_default(value), _prose(docs.get(f.name, "")), verl.get(key, [])))
        for value, sub in nested:
            walk(value, sub)

    walk(TrainConfig(), "")
    return [s for s in out if s.entries or s.name]


def _verl_tables() -> str:
    from agentloop_trainer.config import verl_compat

    lines = ["## verl keys accepted without effect", "",
             "Read from a verl config and ignored, with a one-line notice: each key below, and every key "
             "under a section ending in `.`:", ""]
    for prefix in sorted(verl_compat.NO_EFFECT):
        why = verl_compat.REASONS.get(prefix)
        lines.append(f"- `{prefix}`" + (f": {why}" if why else ""))
    lines += ["", "## verl keys accepted at one value", "",
              "Any other value is an error that says why:", ""]
    for key, (allowed, why) in sorted(verl_compat.ONLY_VALUE.items()):
        values = ", ".join(f"`{format_default(v)}`" for v in allowed)
        lines.append(f"- `{key}` = {values}: {why}")
    return "\n".join(lines) + "\n"


def render() -> str:
    """The whole reference page as Markdown."""
    from agentloop_trainer.config import FREE_FORM

    lines = [
        "# Config reference", "",
        "Generated from the typed config (`agentloop_trainer.config`) when the site is built: every key "
        "`agentloop train` reads, its default, what it does and, where verl spells it differently, the "
        "verl spelling that is read as it. `agentloop train --show-config` prints the same defaults as YAML; "
        "set any key as `key=value` on the command line or in a `--config` YAML file.", "",
        "Sections whose keys are your own (checked by the engine, loop or reward they configure): "
        + ", ".join(f"`{p}<name>`" for p in FREE_FORM) + ".", "",
    ]
    for section in sections():
        if not section.name:
            continue
        lines += [f"## `{section.name}`", ""]
        if section.doc:
            lines += [section.doc, ""]
        for e in section.entries:
            verl = f" (verl: {', '.join(f'`{k}`' for k in e.verl)})" if e.verl else ""
            lines.append(f"- **`{e.key}`** = `{e.default}`{verl}")
            if e.doc:
                lines.append(f"    {e.doc}")
            lines.append("")
    lines.append(_verl_tables())
    return "\n".join(lines)


def on_files(files: Any, config: Any) -> Any:
    """mkdocs hook: add the generated page to the site's files."""
    from mkdocs.structure.files import File

    files.append(File.generated(config, PAGE, content=render()))
    return files
