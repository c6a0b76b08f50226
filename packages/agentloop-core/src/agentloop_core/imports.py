"""Objects named by import path in configs (loop classes, tool classes, interactions)."""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["import_object"]


def import_object(path: str, *, where: str = "class_name") -> Any:
    """Import ``"pkg.module.Name"`` (or ``"pkg.module:Name"``).

    Raises:
        ValueError: The path is malformed, the module cannot be imported, or it lacks the name.
    """
    if not isinstance(path, str) or not path.strip():
        raise ValueError(f"{where}: expected a dotted import path like 'pkg.module.Class', got {path!r}")
    module_name, sep, attr = path.partition(":") if ":" in path else path.rpartition(".")
    if not module_name or not attr or not sep:
        raise ValueError(f"{where}: {path!r} is not a dotted import path like 'pkg.module.Class'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"{where}: cannot import module {module_name!r} for {path!r}: {exc}") from exc
    try:
        return getattr(module, attr)
    except AttributeError:
        raise ValueError(f"{where}: module {module_name!r} has no attribute {attr!r}") from None
