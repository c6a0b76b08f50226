"""Names kept for one release after a rename: reading the old name works and warns with the
new one, so a user's code keeps running while it tells them what to change."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["renamed_attributes"]


def renamed_attributes(module: str, renamed: Mapping[str, tuple[str, Callable[[], Any]]]) -> Callable[[str], Any]:
    """A module ``__getattr__`` that serves each old name of ``renamed`` with a
    ``DeprecationWarning`` (attributed to the caller's line).

    Args:
        module: The module's ``__name__``, for messages.
        renamed: Old name -> (the new name as users should spell it, a function returning the
            object; a function so the new object may live in a module imported lazily).

    Returns:
        The function to assign to the module's ``__getattr__``.
    """

    def __getattr__(name: str) -> Any:
        if name in renamed:
            new_name, get = renamed[name]
            warnings.warn(f"{module}.{name} is deprecated and will be removed in the next release; use {new_name}",
                          DeprecationWarning, stacklevel=2)
            return get()
        raise AttributeError(f"module {module!r} has no attribute {name!r}")

    return __getattr__
