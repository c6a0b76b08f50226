"""Agent loops by name: ``@register("name")`` in code, or the ``agentloop.agent_loops``
entry-point group for installed packages."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping, Sequence
from importlib.metadata import entry_points
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    from agentloop_core.loop import AgentLoopBase

ENTRY_POINT_GROUP = "agentloop.agent_loops"

_REGISTRY: dict[str, type[AgentLoopBase]] = {}
# Entry points that failed to import, by name: reported when someone asks for that name (or
# for an unknown one), never allowed to break lookups of loops that do import.
_BROKEN: dict[str, str] = {}
L = TypeVar("L", bound="type[AgentLoopBase]")


class UnknownAgentLoopError(KeyError):
    """No agent loop is registered under the requested name."""

    def __str__(self) -> str:  # KeyError quotes its message; keep it readable
        return str(self.args[0])


def register(name: str) -> Callable[[L], L]:
    """Register an :class:`~agentloop_core.loop.AgentLoopBase` subclass under ``name``.

    Raises:
        ValueError: if another class already holds the name.
    """

    def decorator(cls: L) -> L:
        existing = _REGISTRY.get(name)
        if existing is not None and existing is not cls:
            raise ValueError(
                f"agent loop name {name!r} is already registered by "
                f"{existing.__module__}.{existing.__qualname__}; pick another name"
            )
        _REGISTRY[name] = cls
        cls.agent_name = name
        return cls

    return decorator


def _load_entry_points() -> None:
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name in _REGISTRY:
            continue
        try:
            cls = ep.load()  # importing the module usually registers it too
        except Exception as exc:  # noqa: BLE001 - one broken plugin must not hide the others
            _BROKEN[ep.name] = f"entry point {ep.value!r} failed to import: {type(exc).__name__}: {exc}"
            continue
        _REGISTRY.setdefault(ep.name, cls)


def registered_names() -> list[str]:
    """All known agent loop names, entry points included."""
    _load_entry_points()
    return sorted(_REGISTRY)


def get_agent_loop_class(name: str) -> type[AgentLoopBase]:
    """Look up an agent loop class by name.

    Raises:
        UnknownAgentLoopError: listing the known names and how to add one.
    """
    if name not in _REGISTRY:
        _load_entry_points()
    try:
        return _REGISTRY[name]
    except KeyError:
        known = ", ".join(sorted(_REGISTRY)) or "(none)"
        if name in _BROKEN:
            raise UnknownAgentLoopError(f"agent loop {name!r} is installed but broken: {_BROKEN[name]}") from None
        raise UnknownAgentLoopError(
            f"unknown agent loop {name!r}; known agent loops: {known}. Register one with "
            f"@agentloop_core.register({name!r}) or an entry point in the "
            f"{ENTRY_POINT_GROUP!r} group."
        ) from None


def register_loop_classes(classes: Mapping[str, str]) -> None:
    """Register loops given by import path (``{name: "pkg.module:Class"}``) under their names.

    Raises:
        ValueError: naming the loop when its path cannot be imported or is not an agent loop.
    """
    from agentloop_core.imports import import_object
    from agentloop_core.loop import AgentLoopBase

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
