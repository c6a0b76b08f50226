"""Step (a) of the GPU check: what this machine is. Prints one ``GPU_CHECK_NUMBERS {json}`` line:
the GPU (name, capability, memory), torch / CUDA / transformers and the other libraries the
check leans on, and our packages' versions (in the repo, and installed when they are).

Exits 0 whenever it could look, CUDA or not: whether the later steps run is the check's call.
"""

from __future__ import annotations

import importlib.metadata
import json
import platform
import sys
from pathlib import Path
from typing import Any

import tomllib

ROOT = Path(__file__).resolve().parents[2]
LIBRARIES = ("transformers", "tokenizers", "safetensors", "accelerate", "peft", "numpy", "pytest",
             "pytest-asyncio", "omegaconf", "pydantic", "gguf", "hatchling")
"""Third-party distributions whose versions the result file records (missing ones: null)."""


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def our_packages(root: Path = ROOT) -> dict[str, dict[str, str | None]]:
    """Each in-repo package's version in its pyproject.toml and the installed one (null: not
    installed in this interpreter)."""
    found: dict[str, dict[str, str | None]] = {}
    for pyproject in sorted([*root.glob("packages/*/pyproject.toml"), root / "conformance" / "pyproject.toml"]):
        if not pyproject.exists():
            continue
        project = tomllib.loads(pyproject.read_text(encoding="utf-8")).get("project", {})
        name = project.get("name")
        if name:
            found[name] = {"repo": project.get("version"), "installed": _version(name)}
    return found


def probe() -> dict[str, Any]:
    numbers: dict[str, Any] = {
        "python": sys.version.split()[0], "executable": sys.executable, "platform": platform.platform(),
        "libraries": {name: _version(name) for name in LIBRARIES}, "packages": our_packages(),
    }
    try:
        import torch
    except Exception as exc:  # any import failure (missing, broken CUDA libs) is the finding
        numbers.update(torch=None, cuda_available=False, cuda_reason=f"torch is not importable: {type(exc).__name__}: {exc}")
        return numbers
    numbers.update(torch=torch.__version__, torch_cuda=torch.version.cuda)
    if not torch.cuda.is_available():
        numbers.update(cuda_available=False, cuda_reason=(
            f"no CUDA GPU: torch.cuda.is_available() is False (torch {torch.__version__}, built for CUDA "
            f"{torch.version.cuda}); run the check on a machine lent a GPU (README.md, 'A GPU check in one command')"))
        return numbers
    props = torch.cuda.get_device_properties(0)
    free, total = torch.cuda.mem_get_info(0)
    numbers.update(
        cuda_available=True, gpu=props.name, gpu_count=torch.cuda.device_count(),
        capability=f"{props.major}.{props.minor}", multiprocessors=props.multi_processor_count,
        memory_gib=round(total / 2**30, 1), free_gib=round(free / 2**30, 1),
        bf16_supported=torch.cuda.is_bf16_supported(),
    )
    return numbers


if __name__ == "__main__":
    print("GPU_CHECK_NUMBERS " + json.dumps(probe()), flush=True)
