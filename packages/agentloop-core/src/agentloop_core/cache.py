"""Where agentloop keeps what it builds (tiny tokenizer, tiny model)."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path


def cache_dir() -> Path:
    """``$AGENTLOOP_CACHE_DIR``, else ``$XDG_CACHE_HOME/agentloop``, else ``~/.cache/agentloop``."""
    explicit = os.environ.get("AGENTLOOP_CACHE_DIR")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "agentloop"


def build_once(target: Path, build: Callable[[Path], None], marker: str = ".complete") -> Path:
    """Build into ``target`` unless a complete build is already there.

    The build writes into a temporary sibling folder that is renamed into place, so a process
    killed mid-build never leaves a half-written folder that a later run would load.
    """
    target = Path(target)
    if (target / marker).exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        build(tmp)
        (tmp / marker).write_text("ok\n")
        try:
            os.replace(tmp, target)
        except OSError:
            # Another process finished first (target exists and is not empty): keep theirs.
            if not (target / marker).exists():
                shutil.rmtree(target, ignore_errors=True)
                os.replace(tmp, target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target
