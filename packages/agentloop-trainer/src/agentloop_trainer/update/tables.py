"""The name -> record tables the update's algorithms live in: advantage estimators
(:mod:`~agentloop_trainer.update.advantages`), policy losses
(:mod:`~agentloop_trainer.update.losses`) and rollout-correction levels and options
(:mod:`~agentloop_trainer.update.rollout_correction`).

A record holds the function and its constraints side by side (the group size an estimator
needs, the level a loss clips at, the bounds an option takes), and the config checks read both
from the table, so adding one is one registration in one module. A table is a
:class:`agentloop_core.plugins.PluginRegistry` (an installed package adds one through the
table's entry-point group, naming a module whose decorator registers it, or the record itself),
with three differences: names keep their registration order (errors list the built-ins first,
as the docs do), an unknown name raises :class:`UnknownAlgorithmError`, a ``ValueError`` (what
the update's functions have always raised), and a name may be registered again with an equal
record.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, TypeVar

from agentloop_core.plugins import InvalidPluginError, PluginRegistry, UnknownPluginError

__all__ = ["AlgorithmTable", "UnknownAlgorithmError"]

R = TypeVar("R")


class UnknownAlgorithmError(UnknownPluginError, ValueError):
    """A name that is not in its table; the message lists the registered names."""


class AlgorithmTable(PluginRegistry[R]):
    """Records of one kind of algorithm by name, in registration order.

    Args:
        key: What a name is, for messages (``"adv_estimator"``, ``"policy_loss.loss_mode"``).
        group: The entry-point group installed packages add records through.
        record: The record class; an entry point must hold one (or register one on import).
        how_to_add: The sentence that ends the unknown-name error.
    """

    def __init__(self, key: str, group: str, record: type[R], how_to_add: str) -> None:
        def adopt(name: str, obj: Any) -> R:
            if not isinstance(obj, record):
                raise InvalidPluginError(f"is not a {record.__name__} (and importing it registered no {key} "
                                         f"{name!r}); point it at the module that registers it")
            return obj

        super().__init__(key, group, how_to_add=lambda _name: how_to_add, error=UnknownAlgorithmError,
                         adopt=adopt, describe=repr, same=lambda a, b: a == b)

    def find(self, name: str) -> R | None:
        """The record under ``name``, None when there is none."""
        try:
            return self.get(name)
        except UnknownAlgorithmError:
            return None

    def names(self, *, aliases: bool = True, include_broken: bool = False) -> list[str]:  # noqa: ARG002
        """The registered names, in registration order (built-ins first; a table has no aliases)."""
        self.load_entry_points()
        return [*self.entries, *(n for n in self.broken if include_broken and n not in self.entries)]

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and self.find(name) is not None

    def __iter__(self) -> Iterator[R]:
        self.load_entry_points()
        return iter(list(self.entries.values()))

    def remove(self, name: str) -> None:
        """Drop ``name`` (a test that registered one leaves no trace).

        Raises:
            UnknownAlgorithmError: no record under ``name``.
        """
        self.get(name)
        del self.entries[name]

    def unknown(self, name: str) -> UnknownPluginError:
        """``unknown KEY 'name'; valid: a, b, c. How to add one.`` (or why its entry point is broken)."""
        if name in self.broken:
            return self.error(f"{self.kind} {name!r} is installed but broken: {self.broken[name]}")
        return self.error(f"unknown {self.kind} {name!r}; valid: {', '.join(self.entries)}. {self.how_to_add(name)}")

