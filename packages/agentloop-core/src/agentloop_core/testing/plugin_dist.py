"""An installed third-party package, written to a folder in a test: its modules plus a
``.dist-info`` with its entry points, found by ``importlib.metadata`` once the folder is on
``sys.path`` (no pip, no build; the registries see it exactly as a pip-installed package).

:data:`DEMO_PARSERS_SOURCE` is such a package's module: a tool-call parser and a reasoning
parser in formats no built-in parser reads, registered only by entry point
(:data:`DEMO_PARSERS_ENTRY_POINTS`).
"""

from __future__ import annotations

import contextlib
import sys
import textwrap
from collections.abc import Iterator, Mapping
from pathlib import Path

from agentloop_core.parsers import registry as tool_parser_registry
from agentloop_core.reasoning import registry as reasoning_parser_registry

__all__ = ["DEMO_PARSERS_ENTRY_POINTS", "DEMO_PARSERS_MODULE", "DEMO_PARSERS_SOURCE", "installed_parser_plugins",
           "write_distribution"]


def write_distribution(root: Path, name: str, *, modules: Mapping[str, str],
                       entry_points: Mapping[str, Mapping[str, str]]) -> Path:
    """Write distribution ``name`` (version 0.1) into ``root``.

    Args:
        root: The folder to put on ``sys.path``.
        name: The distribution's name.
        modules: Module name -> source (dedented).
        entry_points: Group -> {entry-point name: ``"module:attr"``}.

    Returns:
        ``root``.
    """
    root.mkdir(parents=True, exist_ok=True)
    for module, source in modules.items():
        (root / f"{module}.py").write_text(textwrap.dedent(source))
    info = root / f"{name.replace('-', '_')}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("".join(
        f"[{group}]\n" + "".join(f"{ep} = {value}\n" for ep, value in eps.items()) + "\n"
        for group, eps in entry_points.items()))
    return root


DEMO_PARSERS_MODULE = "agentloop_demo_parsers"

DEMO_PARSERS_SOURCE = '''
    """A third-party package's parsers: ``<call>{json}</call>`` tool calls after the content, and
    reasoning between ``[think]`` and ``[/think]``."""

    import json

    from agentloop_core.parsers import ParseResult, ToolCall, ToolCallError, ToolParser, json_error
    from agentloop_core.reasoning import ReasoningParser, ReasoningSplit

    OPEN, CLOSE = "<call>", "</call>"


    class AngleCallToolParser(ToolParser):
        call_openings = (OPEN,)

        def _parse(self, text, tools):
            at = text.find(OPEN)
            if at < 0:
                return ParseResult(content=text.strip())
            calls, errors = [], []
            for index, block in enumerate(text[at:].split(OPEN)[1:]):
                body, closed, _ = block.partition(CLOSE)
                if not closed:
                    errors.append(ToolCallError(OPEN + block, f"{OPEN} is never closed; end it with {CLOSE}",
                                                "unclosed_tag"))
                    continue
                try:
                    payload = json.loads(body)
                except ValueError as exc:
                    errors.append(ToolCallError(body, json_error(exc)))
                    continue
                call = self.build_call(body, payload, index, tools, ("arguments",))
                (calls if isinstance(call, ToolCall) else errors).append(call)
            return ParseResult(content=text[:at].strip(), calls=calls, errors=errors)


    class BracketReasoningParser(ReasoningParser):
        @property
        def delimiters(self):
            return ("[think]", "[/think]")

        def split(self, text, *, in_reasoning=False):
            start = 0 if in_reasoning else text.find("[think]")
            if start < 0:
                return ReasoningSplit("", text)
            body = start if in_reasoning else start + len("[think]")
            end = text.find("[/think]", body)
            if end < 0:
                return ReasoningSplit(text[body:].strip(), text[:start], closed=False)
            return ReasoningSplit(text[body:end].strip(), text[:start] + text[end + len("[/think]"):])


    NOT_A_PARSER = object()
'''

DEMO_PARSERS_ENTRY_POINTS: dict[str, dict[str, str]] = {
    tool_parser_registry.ENTRY_POINT_GROUP: {
        "demo_angle": f"{DEMO_PARSERS_MODULE}:AngleCallToolParser",
        "demo_broken": "agentloop_no_such_parser_module:Parser",
        "demo_not_a_parser": f"{DEMO_PARSERS_MODULE}:NOT_A_PARSER",
    },
    reasoning_parser_registry.ENTRY_POINT_GROUP: {
        "demo_brackets": f"{DEMO_PARSERS_MODULE}:BracketReasoningParser",
    },
}


@contextlib.contextmanager
def installed_parser_plugins(root: Path, *, modules: Mapping[str, str] | None = None,
                             entry_points: Mapping[str, Mapping[str, str]] | None = None) -> Iterator[Path]:
    """A parser package installed in ``root`` and on ``sys.path`` for the ``with`` block (the
    demo package unless ``modules`` and ``entry_points`` say otherwise); afterwards the path,
    its imported modules and what the parser registries learnt from it are gone again."""
    modules = modules if modules is not None else {DEMO_PARSERS_MODULE: DEMO_PARSERS_SOURCE}
    write_distribution(root, "agentloop-demo-parsers", modules=modules,
                       entry_points=entry_points if entry_points is not None else DEMO_PARSERS_ENTRY_POINTS)
    tools_saved, reasoning_saved = tool_parser_registry.PARSERS.snapshot(), reasoning_parser_registry.PARSERS.snapshot()
    sys.path.insert(0, str(root))
    try:
        yield root
    finally:
        sys.path.remove(str(root))
        for module in modules:
            sys.modules.pop(module, None)
        tool_parser_registry.PARSERS.restore(tools_saved)
        reasoning_parser_registry.PARSERS.restore(reasoning_saved)
