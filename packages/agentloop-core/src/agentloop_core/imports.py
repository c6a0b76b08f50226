"""Objects named by import path in configs (loop classes, tool classes, interactions)."""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
from pathlib import Path
from typing import Any

__all__ = ["import_file", "import_object"]


def import_object(path: str, *, where: str = "class_name") -> Any:
    """Import ``"pkg.module.Name"`` (or ``"pkg.module:Name"``), or ``"path/to/file.py:Name"``
    (the file imported once per process with :func:`import_file`).

    Raises:
        ValueError: The path is malformed, the module cannot be imported, or it lacks the name.
        FileNotFoundError: A ``.py`` file that does not exist.
    """
    if not isinstance(path, str) or not path.strip():
        raise ValueError(f"{where}: expected a dotted import path like 'pkg.module.Class', got {path!r}")
    module_name, sep, attr = path.rpartition(":") if ":" in path else path.rpartition(".")
    if not module_name or not attr or not sep:
        raise ValueError(f"{where}: {path!r} is not a dotted import path like 'pkg.module.Class' or a file "
                         "like 'agent.py:run'")
    if module_name.endswith(".py"):
        module = import_file(module_name, where)
    else:
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            raise ValueError(f"{where}: cannot import module {module_name!r} for {path!r}: {exc}") from exc
    try:
        return getattr(module, attr)
    except AttributeError:
        raise ValueError(f"{where}: module {module_name!r} has no attribute {attr!r}") from None


def import_file(path: str | Path, what: str, prefix: str = "agentloop_user") -> Any:
    """Import a Python file by path, once per process (a second call returns the same module).

    Args:
        path: The ``.py`` file.
        what: What the file is, for errors (``"function tool file"``, ``"custom_reward_function.path"``).
        prefix: Start of the module name under which it is registered in ``sys.modules``.

    Raises:
        FileNotFoundError: No such file.
        ValueError: The file fails to import (its exception named).
    """
    file = Path(path).expanduser().resolve()
    if not file.is_file():
        raise FileNotFoundError(f"{what} {str(file)!r} does not exist")
    # A stable, unique module name so two files called tools.py do not replace each other.
    module_name = f"{prefix}_{hashlib.sha1(str(file).encode()).hexdigest()[:12]}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(module_name, file)
    if spec is None or spec.loader is None:
        raise ValueError(f"{file}: cannot be imported as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        sys.modules.pop(module_name, None)
        raise ValueError(f"{file}: importing the {what} failed: {type(exc).__name__}: {exc}") from exc
    return module
