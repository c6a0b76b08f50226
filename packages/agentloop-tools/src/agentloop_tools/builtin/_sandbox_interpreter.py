"""Which interpreter the sandboxed code runs, and which of its folders the private tmpfs would hide.

The private tmpfs masks ``/tmp``, ``/dev/shm`` and ``/var/tmp``. An interpreter that lives under
one of them (a virtual environment made in the system temp folder, a Python unpacked there) or
whose standard library or site-packages do, must still start: :func:`masked_paths` asks the
interpreter itself, with the flags the code gets, where it lives and what it imports from, and
the supervisor binds those folders back, read-only, inside the run's mount namespace.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import threading

from agentloop_tools.builtin._sandbox_supervisor import SHARED_TMP_DIRS

# Its folders, then (after a "--" entry) the files it has mapped: its shared libraries.
_QUERY = ("import json, sys; maps = [line.split(None, 5) for line in open('/proc/self/maps')]; "
          "print(json.dumps([sys.executable, sys.prefix, sys.exec_prefix, sys.base_prefix, sys.base_exec_prefix, "
          "*sys.path, '--', *sorted({m[5].strip() for m in maps if len(m) == 6 and m[5].startswith('/')})]))")
_cache: dict[tuple[str, bool], tuple[str, ...]] = {}
_asked: dict[tuple[str, bool], tuple[list[str], list[str]]] = {}
_cache_lock = threading.Lock()


def reachable_by_others(path: str) -> bool:
    """Whether a uid that owns nothing here can execute ``path`` (every folder on the way
    searchable, the file executable and readable by 'other')."""
    real = os.path.realpath(path)
    try:
        st = os.stat(real)
        if not st.st_mode & stat.S_IXOTH or not st.st_mode & stat.S_IROTH:
            return False
        parent = os.path.dirname(real)
        while True:
            if not os.stat(parent).st_mode & stat.S_IXOTH:
                return False
            if parent == os.path.dirname(parent):
                return True
            parent = os.path.dirname(parent)
    except OSError:
        return False


def choose(python_executable: str | None, dropped: bool) -> str:
    """The interpreter for a run: ``python_executable``, else this one; when the code runs as
    another uid (``dropped``), one that uid can execute.

    Raises:
        ValueError: No interpreter the unprivileged uid can run.
    """
    if not dropped:
        return python_executable or sys.executable
    if python_executable is not None:
        if not reachable_by_others(python_executable):
            raise ValueError(f"sandbox python_executable {python_executable!r} cannot be run by the "
                             "sandbox's unprivileged uid (a folder on its path is closed to other users); "
                             "use an interpreter outside such folders, e.g. /usr/bin/python3")
        return python_executable
    for candidate in (sys.executable, "/usr/bin/python3", "/usr/local/bin/python3"):
        if candidate and reachable_by_others(candidate):
            return candidate
    raise ValueError(f"sandbox: no Python interpreter the unprivileged sandbox uid can run ({sys.executable} is "
                     "in a folder closed to other users); install /usr/bin/python3 or set python_executable")


def _inside(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder.rstrip("/") + "/")


def hidden_paths(paths: list[str], masks: tuple[str, ...] = SHARED_TMP_DIRS) -> tuple[str, ...]:
    """Of ``paths`` (absolute), those under a folder of ``masks``, reduced to the outermost
    ones, each both as written and resolved (a symlink into a masked folder counts).

    Raises:
        ValueError: A path is a masked folder itself: showing it would undo the mask.
    """
    masked = {os.path.realpath(m) for m in masks if os.path.isdir(m)} | {os.path.abspath(m) for m in masks}
    found: set[str] = set()
    for path in paths:
        if not path or not os.path.isabs(path) or not os.path.exists(path):
            continue  # a relative entry, or a zip file that is not there (python311.zip)
        for form in {os.path.abspath(path), os.path.realpath(path)}:
            for mask in masked:
                if form == mask:
                    raise ValueError(
                        f"sandbox: the interpreter needs {form} itself, which the private tmpfs hides (it "
                        f"masks {', '.join(SHARED_TMP_DIRS)}); install it in a folder of its own (e.g. "
                        f"{form}/venv) or elsewhere, or set private_tmp: false")
                if _inside(form, mask):
                    found.add(form)
    outermost: list[str] = []
    for path in sorted(found, key=len):
        if not any(_inside(path, kept) for kept in outermost):
            outermost.append(path)
    return tuple(sorted(outermost))


def _ask(python: str, site: bool) -> tuple[list[str], list[str]]:
    """Where ``python`` lives and what it imports from (its folder, prefixes, ``sys.path`` with
    the code's flags), and the files it maps at start (its shared libraries). Asked once per
    process and cached.

    Raises:
        ValueError: The interpreter does not start.
    """
    key = (python, site)
    with _cache_lock:
        if key in _asked:
            return _asked[key]
    args = [python, "-I", *([] if site else ["-S"]), "-c", _QUERY]
    try:
        proc = subprocess.run(args, capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL,
                              env={"LC_ALL": "C.UTF-8", "PATH": "/usr/bin:/bin"})
        reported = json.loads(proc.stdout) if proc.returncode == 0 else None
    except (OSError, subprocess.TimeoutExpired, ValueError) as exc:
        raise ValueError(f"sandbox: the interpreter {python} does not start ({type(exc).__name__}: {exc}); "
                         "set python_executable to a working one") from None
    if not isinstance(reported, list) or not all(isinstance(p, str) for p in reported) or "--" not in reported:
        raise ValueError(f"sandbox: the interpreter {python} does not start (exit {proc.returncode}: "
                         f"{proc.stderr.strip()[-500:]}); set python_executable to a working one")
    cut = reported.index("--")
    paths = [os.path.dirname(os.path.abspath(python)), *reported[:cut]]
    paths[1] = os.path.dirname(paths[1]) if paths[1] else ""  # sys.executable: its folder
    result = (paths, reported[cut + 1:])
    with _cache_lock:
        _asked[key] = result
    return result


def masked_paths(python: str, site: bool) -> tuple[str, ...]:
    """The folders ``python`` needs at start (its own folder, prefixes, ``sys.path`` as it is
    with ``-I`` and, unless ``site``, ``-S``) that the private tmpfs would hide. Cached.

    Raises:
        ValueError: The interpreter does not start, or needs a masked folder itself.
    """
    key = (python, site)
    with _cache_lock:
        if key in _cache:
            return _cache[key]
    result = hidden_paths(_ask(python, site)[0])
    with _cache_lock:
        _cache[key] = result
    return result


_NEVER_WHOLE = frozenset({"/", "/tmp", "/var/tmp", "/dev/shm", "/dev", "/proc", "/sys", "/home", "/root", "/etc",
                          "/var", "/run", "/mnt", "/media", "/srv", "/opt"})
"""Folders the code's file view never shows whole, though an interpreter may live below them."""


def resolve(path: str, links: dict[str, str] | None = None, depth: int = 0) -> str:
    """``os.path.realpath(path)``, recording in ``links`` each symlink met on the way (its path
    and target as written), so that a view of the file system can recreate the way there."""
    if depth > 40:
        raise ValueError(f"sandbox: too many levels of symbolic links resolving {path}")
    current = "/"
    parts = [p for p in os.path.normpath(path).split("/") if p]
    for i, part in enumerate(parts):
        candidate = os.path.join(current, part)
        if os.path.islink(candidate):
            target = os.readlink(candidate)
            if links is not None:
                links[candidate] = target
            current = resolve(os.path.join(current, target), links, depth + 1)
        else:
            current = candidate
        if i < len(parts) - 1 and not os.path.isdir(current):
            return os.path.realpath(path)  # a dangling or odd path: nothing to recreate
    return current


def file_view(python: str, site: bool, system: tuple[str, ...]) -> dict[str, list]:
    """What the code's root folder shows of the host (see ``_sandbox_rootfs.build_root``): the
    ``system`` folders, the folders ``python`` lives in and imports from, and the folders of
    the shared libraries it maps, as ``binds`` (real paths, outermost only, read-only) and
    ``links`` (the symlinks on the way to them, ``[path, target]``). The interpreter is asked once.

    Raises:
        ValueError: The interpreter does not start, or a folder it needs is ``/`` itself (the
            view would be the whole host).
    """
    paths, libs = _ask(python, site)
    links: dict[str, str] = {}
    found: set[str] = set()
    for path in [*system, python, *paths, *(os.path.dirname(lib) for lib in libs)]:
        if not path or not os.path.isabs(path) or not os.path.exists(path):
            continue  # a relative entry, or a zip file that is not there (python311.zip)
        real = resolve(path, links)
        if real in _NEVER_WHOLE:
            raise ValueError(f"sandbox: the interpreter {python} needs {path} ({real}), which isolate_files would "
                             "have to show whole (every user's or process's files, or over the code's own "
                             "temp folders); install it in a folder of its own, drop that entry from its "
                             "sys.path (a .pth file), or set isolate_files: false")
        found.add(real)
    binds: list[str] = []
    for path in sorted(found, key=len):
        if not any(_inside(path, kept) for kept in binds):
            binds.append(path)
    kept_links = [[p, t] for p, t in sorted(links.items()) if not any(_inside(p, b) for b in binds)]
    return {"binds": sorted(binds), "links": kept_links}
