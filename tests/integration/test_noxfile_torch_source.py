"""The main job's install under nox's uv backend gets a CPU torch: uv reads none of pip's
configuration, so the noxfile hands it pip's find-links when one holds the pinned torch wheel,
and PyTorch's CPU index otherwise (PyPI's Linux torch is a CUDA build with GBs of nvidia-*)."""

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
