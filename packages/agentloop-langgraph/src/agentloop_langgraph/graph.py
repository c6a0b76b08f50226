"""Graph factories: where the ``react_agent`` loop gets the LangGraph graph it runs."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from typing import Any

GraphFactory = Callable[..., Any]
"""``(chat_model, tools, **graph_factory_kwargs) -> compiled graph`` taking ``{"messages": [...]}``."""


def default_graph_factory(chat_model: Any, tools: Sequence[Any], system_prompt: str | None = None) -> Any:
    """A ReAct agent over ``tools``: ``langchain.agents.create_agent`` when ``langchain`` is
    installed, else ``langgraph.prebuilt.create_react_agent``.

    Args:
        chat_model: The :class:`~agentloop_langgraph.ChatModel`.
        tools: LangChain tools.
        system_prompt: Prepended as a system message on every model call.
    """
    try:
        from langchain.agents import create_agent
    except ImportError:
        # create_react_agent is deprecated in langgraph 1.x but still ships with it.
        from langgraph.prebuilt import create_react_agent

        return create_react_agent(chat_model, list(tools), prompt=system_prompt)
    return create_agent(chat_model, list(tools), system_prompt=system_prompt)


def load_graph_factory(spec: str | GraphFactory | None) -> GraphFactory:
    """Resolve the ``graph_factory`` config value.

    Args:
        spec: A callable, an import path ``"package.module:function"``, or None for
            :func:`default_graph_factory`.

    Raises:
        ValueError: a malformed path, or a module/attribute that cannot be imported, or a
            value that is not callable.
    """
    if spec is None:
        return default_graph_factory
    if callable(spec):
        return spec
    if not isinstance(spec, str) or spec.count(":") != 1:
        raise ValueError(f"graph_factory must be a callable or 'package.module:function', got {spec!r}")
    module_name, attr = spec.split(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"graph_factory {spec!r}: cannot import module {module_name!r}: {exc}") from exc
    factory = module
    for part in attr.split("."):
        if not hasattr(factory, part):
            raise ValueError(f"graph_factory {spec!r}: {module_name!r} has no attribute {attr!r}")
        factory = getattr(factory, part)
    if not callable(factory):
        raise ValueError(f"graph_factory {spec!r} is a {type(factory).__name__}, not a callable")
    return factory


__all__ = ["GraphFactory", "default_graph_factory", "load_graph_factory"]
