"""Agent loops by name: ``@register("name")`` in code, or the ``agentloop.agent_loops``
entry-point group for installed packages."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping, Sequence
from typing import TypeVar

from agentloop_core.imports import import_object
from agentloop_core.loop import AgentLoopBase
from agentloop_core.plugins import PluginRegistry, UnknownPluginError

ENTRY_POINT_GROUP = "agentloop.agent_loops"

L = TypeVar("L", bound="type[AgentLoopBase]")


class UnknownAgentLoopError(UnknownPluginError):
    """No agent loop is registered under the requested name."""


_LOOPS: PluginRegistry[type[AgentLoopBase]] = PluginRegistry(
    "agent loop", ENTRY_POINT_GROUP, error=UnknownAgentLoopError,
    how_to_add=lambda name: (f"Register one with @agentloop_core.register({name!r}) or an entry point in the "
                             f"{ENTRY_POINT_GROUP!r} group."))


def register(name: str) -> Callable[[L], L]:
    """Register an :class:`~agentloop_core.loop.AgentLoopBase` subclass under ``name``.

    Raises:
        ValueError: if another class already holds the name.
    """

    def decorator(cls: L) -> L:
        _LOOPS.add(name, cls)
        cls.agent_name = name
        return cls

    return decorator


def registered_names() -> list[str]:
    """All known agent loop names, entry points included."""
    return _LOOPS.names()


def get_agent_loop_class(name: str) -> type[AgentLoopBase]:
    """Look up an agent loop class by name.

    Raises:
        UnknownAgentLoopError: listing the known names and how to add one.
    """
    return _LOOPS.get(name)


def register_loop_classes(classes: Mapping[str, str]) -> None:
    """Register loops given by import path (``{name: "pkg.module:Class"}``) under their names.

    Raises:
        ValueError: naming the loop when its path cannot be imported or is not an agent loop.
    """
    for name, path in classes.items():
        cls = import_object(path, where=f"agent_loop_classes[{name!r}]")
        if not (isinstance(cls, type) and issubclass(cls, AgentLoopBase)):
            raise ValueError(f"agent_loop_classes[{name!r}]: {path!r} is not an AgentLoopBase subclass")
        if name in registered_names() and getattr(cls, "agent_name", None) == name:
            continue  # the module's own @register already did it
        register(name)(cls)


def import_loop_modules(modules: Sequence[str]) -> None:
    """Import modules whose ``@register`` decorators define agent loops.

    Raises:
        ImportError: naming the module and the config key that listed it.
    """
    for module in modules:
        try:
            importlib.import_module(module)
        except ImportError as exc:
            raise ImportError(
                f"cannot import agent loop module {module!r} (from config agent_loop_modules): {exc}"
            ) from exc
