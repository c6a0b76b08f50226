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
                    help="agent loop factory (server -> AgentLoopBase) for the agent loop suite")


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
