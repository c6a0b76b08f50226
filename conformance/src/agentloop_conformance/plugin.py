"""The pytest plugin (entry point ``pytest11``): options for the no-code mode."""

from __future__ import annotations

from typing import Any


def pytest_addoption(parser: Any) -> None:
    group = parser.getgroup("agentloop-conformance", "agentloop conformance suite")
    group.addoption("--agentloop-engine", default=None, metavar="pkg.module:factory",
                    help="engine factory for the no-code engine suite (returns an engine or an EngineTarget)")
    group.addoption("--agentloop-tokenizer", default=None, metavar="PATH",
                    help="Hugging Face tokenizer folder (or pkg.module:factory) for the tokenization suite")
    group.addoption("--agentloop-chat-template", default=None, metavar="FILE",
                    help="Jinja chat template file that replaces the tokenizer's own")
    group.addoption("--agentloop-loop", default=None, metavar="pkg.module:factory",
                    help="agent loop factory (server -> AgentLoopBase, or (server, tokenizer) -> AgentLoopBase "
                         "to take --agentloop-tokenizer) for the agent loop suite")
    group.addoption("--agentloop-replies", default=None, metavar="FILE.json|pkg.module:attr",
                    help="what the scripted engine says to the loop (a JSON list of texts, the last repeating, or "
                         "an object: a list or a (request_id, prompt_ids, index) -> text callable); default: "
                         "turns scripted from the loop's declared tools")


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """One line per agent loop class: the turn kinds its scripted rollout exercised."""
    from agentloop_conformance.agent_loop import TURN_KINDS_PROPERTY

    lines = []
    for reports in terminalreporter.stats.values():
        for report in reports:
            for key, value in getattr(report, "user_properties", None) or ():
                if key == TURN_KINDS_PROPERTY and getattr(report, "when", None) == "call":
                    lines.append(f"{report.nodeid.rsplit('::', 1)[0]}: {value}")
    if lines:
        terminalreporter.write_sep("-", "agentloop turn kinds exercised")
        for line in sorted(set(lines)):
            terminalreporter.write_line(line)


def load_replies(spec: str) -> Any:
    """Scripted replies from a JSON file (a list of texts) or ``pkg.module:attr``."""
    import json
    import os

    if os.path.exists(spec):
        with open(spec, encoding="utf-8") as f:
            replies = json.load(f)
        if not isinstance(replies, list) or not all(isinstance(t, str) for t in replies) or not replies:
            raise ValueError(f"--agentloop-replies={spec!r}: expected a non-empty JSON list of texts")
        return replies
    return load_object(spec, "--agentloop-replies")


def make_loop_factory(factory: Any, tokenizer: Any) -> Any:
    """``factory`` as a ``server -> loop`` callable; when ``tokenizer`` is given and the factory
    takes a second argument or a ``tokenizer`` keyword, the tokenizer is passed to it.

    Raises:
        ValueError: a tokenizer is given but the factory takes only the server.
    """
    import inspect

    if tokenizer is None:
        return factory
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        params = {}
    if "tokenizer" in params or any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return lambda server: factory(server, tokenizer=tokenizer)
    positional = [p for p in params.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(positional) >= 2 or any(p.kind is p.VAR_POSITIONAL for p in params.values()):
        return lambda server: factory(server, tokenizer)
    raise ValueError("--agentloop-tokenizer was given but the --agentloop-loop factory takes only the server; "
                     "make it (server, tokenizer) -> AgentLoopBase to run the loop on that tokenizer")


def load_object(spec: str, option: str) -> Any:
    """Import ``pkg.module:attr`` (attr may be dotted).

    Raises:
        ValueError: when ``spec`` has no ``:`` or the module/attribute does not exist.
    """
    import importlib

    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"{option}={spec!r}: expected pkg.module:factory (a module path, a colon, a name)")
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"{option}={spec!r}: cannot import {module_name!r}: {exc}") from exc
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"{option}={spec!r}: {module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    return obj


async def call_maybe_async(fn: Any, *args: Any) -> Any:
    """Call ``fn`` and await the result when it is awaitable."""
    import inspect

    result = fn(*args)
    if inspect.isawaitable(result):
        result = await result
    return result


def load_tokenizer(spec: str) -> Any:
    """A tokenizer from a Hugging Face folder (or hub id), or from ``pkg.module:factory``."""
    import os

    if ":" in spec and not os.path.exists(spec):
        return load_object(spec, "--agentloop-tokenizer")()
    from transformers import AutoTokenizer

    if not os.path.isdir(spec):
        raise ValueError(f"--agentloop-tokenizer={spec!r}: not a folder; pass a Hugging Face tokenizer folder "
                         "(with tokenizer_config.json) or pkg.module:factory")
    return AutoTokenizer.from_pretrained(spec)
