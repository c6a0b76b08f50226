"""One registry for every kind of plug-in (agent loops, environments, engines, tool-call and
reasoning parsers): a name -> object table, filled in code (a decorator or a call) and from an
entry-point group for installed packages.

A package adds a plug-in by naming it in its ``pyproject.toml``::

    [project.entry-points."agentloop.tool_parsers"]
    my_format = "my_pkg.parser:MyFormatToolParser"

Entry points are read lazily: when the names are listed, or when a name is asked for that is
not registered yet, so a package installed while the process runs is still found. Each entry
point is imported at most once; one that fails to import, or holds something that is not a
plug-in of the kind, is remembered as broken and named in the error for that name (and in the
error for an unknown one), never allowed to hide the plug-ins that do load. A name registered in
code wins over an entry point of the same name (a built-in module that also declares its own
entry point registers itself on import).
"""

from __future__ import annotations

import difflib
import threading
from collections.abc import Callable, Sequence
from importlib.metadata import EntryPoint, entry_points
from typing import Any, Generic, TypeVar

__all__ = ["InvalidPluginError", "NamedClassRegistry", "PluginRegistry", "UnknownPluginError", "describe_class"]

T = TypeVar("T")


class UnknownPluginError(KeyError):
    """No plug-in of the kind is registered under the requested name (each registry raises its
    own subclass: ``UnknownToolParserError``, ``UnknownEngineError``...)."""

    def __str__(self) -> str:  # KeyError quotes its message; keep it readable
        return str(self.args[0])


class InvalidPluginError(TypeError):
    """Raised by a registry's ``adopt`` hook: the entry point's object is not a plug-in of the
    kind. The message completes ``entry point 'pkg.mod:obj' ...`` (e.g. ``is not a ToolParser
    subclass``)."""


def describe_class(obj: Any) -> str:
    """``module.Qualname`` of a class (what a duplicate-name error names), ``repr`` otherwise."""
    if isinstance(obj, type):
        return f"{obj.__module__}.{obj.__qualname__}"
    return repr(obj)


class PluginRegistry(Generic[T]):
    """Plug-ins of one kind by name, with aliases, an entry-point group and broken-plug-in
    isolation.

    Args:
        kind: What one plug-in is, for messages (``"tool parser"``).
        group: The entry-point group (``"agentloop.tool_parsers"``).
        how_to_add: The sentence that ends the unknown-name error, given the name asked for:
            how to register one in code and by entry point.
        error: The ``KeyError`` subclass raised for an unknown or broken name.
        adopt: Checks (and may complete, e.g. set the class's ``name``) what an entry point
            loaded, given the entry-point name; raises :class:`InvalidPluginError` to refuse it.
            None: taken as it is.
        describe: How the holder of a name is named in a duplicate-name error.
        same: When registering an object under a taken name is not a conflict (default: it is
            the same object; engines compare their records by value).
        known_label: Heads the list of names in the unknown-name error (default ``known <kind>s``).
        capabilities: The capability record of a plug-in (:meth:`capabilities`), when the kind
            declares one (engines: :class:`~agentloop_core.engine_registry.EngineCapabilities`).
    """

    def __init__(self, kind: str, group: str, *, how_to_add: Callable[[str], str],
                 error: type[UnknownPluginError] = UnknownPluginError,
                 adopt: Callable[[str, Any], T] | None = None,
                 describe: Callable[[T], str] = describe_class,
                 same: Callable[[T, T], bool] = lambda a, b: a is b,
                 known_label: str | None = None,
                 capabilities: Callable[[T], Any] | None = None) -> None:
        self.kind = kind
        self.group = group
        self.how_to_add = how_to_add
        self.error = error
        self.adopt = adopt
        self.describe = describe
        self.same = same
        self.known_label = known_label or f"known {kind}s"
        self._capabilities = capabilities
        self.entries: dict[str, T] = {}
        """Registered plug-ins by name."""
        self.aliases: dict[str, str] = {}
        """Alias -> registered name."""
        self.broken: dict[str, str] = {}
        """Entry points that failed to load, by name: why."""
        # Re-entrant: an entry point's module may list this registry's names while it imports.
        self._lock = threading.RLock()

    def add(self, name: str, obj: T, *, aliases: Sequence[str] = ()) -> T:
        """Register ``obj`` under ``name`` (and ``aliases``, which resolve to the same object).

        Raises:
            ValueError: another object holds the name or one of the aliases.
        """
        for taken in (name, *aliases):
            existing = self.entries.get(self.aliases.get(taken, taken))
            if existing is not None and not self.same(existing, obj):
                raise ValueError(f"{self.kind} name {taken!r} is already registered by {self.describe(existing)}; "
                                 "pick another name")
        self.entries[name] = obj
        for alias in aliases:
            self.aliases[alias] = name
        self.broken.pop(name, None)
        return obj

    def resolve(self, name: str) -> str:
        """The registered name ``name`` stands for (itself unless it is an alias)."""
        return self.aliases.get(name, name)

    def get(self, name: str) -> T:
        """The plug-in registered under ``name`` (or an alias of it).

        Raises:
            UnknownPluginError: (the registry's subclass) listing the known names, a close
                match and how to add one, or saying why the entry point of that name is broken.
        """
        if self.resolve(name) not in self.entries:
            self.load_entry_points()
        try:
            return self.entries[self.resolve(name)]
        except KeyError:
            raise self.unknown(name) from None

    def names(self, *, aliases: bool = True, include_broken: bool = False) -> list[str]:
        """Every name :meth:`get` accepts, entry points included.

        Args:
            aliases: Include the aliases.
            include_broken: Include entry points that failed to load.
        """
        self.load_entry_points()
        return sorted({*self.entries, *(self.aliases if aliases else ()), *(self.broken if include_broken else ())})

    def capabilities(self, name: str) -> Any:
        """The capability record of the plug-in under ``name``.

        Raises:
            TypeError: this kind of plug-in declares no capability record.
        """
        if self._capabilities is None:
            raise TypeError(f"{self.kind} plug-ins declare no capability record; read the attributes of the "
                            f"{self.kind} itself")
        return self._capabilities(self.get(name))

    def load_entry_points(self) -> None:
        """Import the entry points of :attr:`group` not seen yet (see the module docstring)."""
        with self._lock:
            by_name: dict[str, list[EntryPoint]] = {}
            for ep in entry_points(group=self.group):
                by_name.setdefault(ep.name, []).append(ep)
            for name, found in by_name.items():
                if name in self.entries or name in self.aliases or name in self.broken:
                    continue
                values = sorted({ep.value for ep in found})
                if len(values) > 1:
                    self.broken[name] = (f"more than one installed package declares it in {self.group!r} "
                                         f"({', '.join(values)}); uninstall all but one")
                    continue
                self._load(found[0])

    def _load(self, ep: EntryPoint) -> None:
        try:
            obj = ep.load()  # importing the module often registers the plug-in too
        except Exception as exc:  # noqa: BLE001 - one broken plug-in must not hide the others
            self.broken[ep.name] = f"entry point {ep.value!r} failed to import: {type(exc).__name__}: {exc}"
            return
        if ep.name in self.entries:  # its module's own decorator registered it under this name
            return
        try:
            self.entries[ep.name] = self.adopt(ep.name, obj) if self.adopt is not None else obj
        except InvalidPluginError as exc:
            self.broken[ep.name] = f"entry point {ep.value!r} {exc}"

    def snapshot(self) -> tuple[dict[str, T], dict[str, str], dict[str, str]]:
        """Copies of the tables, for a test that installs a plug-in and must leave no trace."""
        return dict(self.entries), dict(self.aliases), dict(self.broken)

    def restore(self, snapshot: tuple[dict[str, T], dict[str, str], dict[str, str]]) -> None:
        """Put back the tables :meth:`snapshot` copied (in place: holders of the dicts see it)."""
        entries, aliases, broken = snapshot
        self.entries.clear()
        self.entries.update(entries)
        for table, saved in ((self.aliases, aliases), (self.broken, broken)):
            table.clear()
            table.update(saved)

    def unknown(self, name: str) -> UnknownPluginError:
        """The error for a name :meth:`get` cannot resolve."""
        if name in self.broken:
            return self.error(f"{self.kind} {name!r} is installed but broken: {self.broken[name]}")
        known = [f"{n} (alias of {self.aliases[n]})" if n in self.aliases else n
                 for n in sorted({*self.entries, *self.aliases})]
        close = difflib.get_close_matches(name, [*self.entries, *self.aliases], n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        broken = f" (installed but broken: {', '.join(sorted(self.broken))})" if self.broken else ""
        return self.error(f"unknown {self.kind} {name!r}; {self.known_label}: {', '.join(known) or '(none)'}"
                          f"{broken}{hint}. {self.how_to_add(name)}")


C = TypeVar("C", bound=type)
K = TypeVar("K", bound=type)


class NamedClassRegistry(PluginRegistry[C]):
    """Plug-ins that are subclasses of ``base``, each named by its registry name (the class's
    ``name`` attribute is set to it) and served as one shared instance per name (tool-call and
    reasoning parsers).

    Args:
        kind: What one plug-in is, for messages (``"tool parser"``).
        group: The entry-point group.
        base: The class every plug-in subclasses.
        base_path: ``base``'s public import path, for messages.
        how_to_add: As for :class:`PluginRegistry`.
        error: As for :class:`PluginRegistry`.
    """

    def __init__(self, kind: str, group: str, base: type, *, base_path: str, how_to_add: Callable[[str], str],
                 error: type[UnknownPluginError] = UnknownPluginError) -> None:
        super().__init__(kind, group, how_to_add=how_to_add, error=error, adopt=self._adopt_class)
        self.base = base
        self.base_path = base_path
        self._instances: dict[str, Any] = {}

    def _adopt_class(self, name: str, cls: Any) -> C:
        if not (isinstance(cls, type) and issubclass(cls, self.base)):
            raise InvalidPluginError(f"is not an {self.base_path} subclass (got {cls!r}); point it at the {self.kind} "
                                     "class")
        own = cls.__dict__.get("name")  # a subclass inherits its parent's name; only its own counts
        if own and own != name:
            raise InvalidPluginError(f"holds the {self.kind} named {own!r}; the entry-point name and the name the "
                                     "class registers must agree")
        cls.name = name
        return cls  # pyright: ignore[reportReturnType] - checked to subclass base above

    def register(self, name: str, *, aliases: Sequence[str] = ()) -> Callable[[K], K]:
        """A class decorator registering the class under ``name`` (and ``aliases``, which
        resolve to the same class and the same shared instance) and setting its ``name``.

        Raises:
            ValueError: another class already holds the name or one of the aliases.
        """

        def decorator(cls: K) -> K:
            self.add(name, cls, aliases=aliases)  # pyright: ignore[reportArgumentType] - a subclass of base
            cls.name = name  # pyright: ignore[reportAttributeAccessIssue] - every plug-in class has a name
            return cls

        return decorator

    def instance(self, name: str) -> Any:
        """The shared instance of the class registered under ``name`` (or an alias of it).

        Raises:
            UnknownPluginError: (the registry's subclass) as :meth:`PluginRegistry.get`.
        """
        cls = self.get(name)
        shared = self._instances.get(cls.name)
        if shared is None or type(shared) is not cls:  # none yet, or the name holds another class now
            shared = self._instances[cls.name] = cls()
        return shared
