"""Shared helpers for the benchmarks: machine facts, result files and plain-text tables.

Every benchmark prints a table and writes ``bench/results/<name>.json`` with the numbers, the
machine, the load average at run time and what exactly was measured. Nothing here asserts on
time: on a shared 2-core machine the numbers move, so each file records the load it ran under.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
RESULTS_DIR = BENCH_DIR / "results"
REPO_ROOT = BENCH_DIR.parent


def machine() -> dict[str, Any]:
    """What the numbers were measured on (CPU count, arch, python, load average now)."""
    info: dict[str, Any] = {
        "arch": platform.machine(),
        "cpus": os.cpu_count(),
        "python": sys.version.split()[0],
        "platform": platform.platform(terse=True),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
    }
    with suppress(OSError, StopIteration):
        info["cpu_model"] = next(
            line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        )
    return info


def agentloop_command() -> list[str]:
    """``agentloop`` next to this interpreter, else ``python -m agentloop_trainer.cli.main``."""
    script = Path(sys.executable).with_name("agentloop")
    return [str(script)] if script.exists() else [sys.executable, "-m", "agentloop_trainer.cli.main"]


def run_agentloop_train(run_dir: Path, overrides: Sequence[str], env: dict[str, str] | None = None,
                        label: str = "") -> tuple[dict[str, Any], float]:
    """Run ``agentloop train`` into ``run_dir`` as a user would (both cores: no
    ``OMP_NUM_THREADS``), its output shown; returns its ``summary.json`` and the command's wall
    seconds. Exits with the command's status when it fails."""
    import subprocess

    full_env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1", **(env or {})}
    full_env.pop("OMP_NUM_THREADS", None)
    cmd = [*agentloop_command(), "train", f"trainer.default_local_dir={run_dir}", "trainer.progress_bar=false",
           *overrides]
    print("running:", " ".join(cmd), flush=True)
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO_ROOT, env=full_env)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"agentloop train {label}failed with exit code {proc.returncode} (output above)")
    return json.loads((Path(run_dir) / "summary.json").read_text()), wall


def load_average() -> list[float]:
    """The 1/5/15-minute load averages (other jobs share this machine)."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []


def versions(*modules: str) -> dict[str, str]:
    """Installed versions of ``modules`` (missing ones are reported as such, not skipped)."""
    from importlib import metadata

    out = {}
    for name in modules:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = "not installed"
    return out


def write_result(name: str, payload: dict[str, Any]) -> Path:
    """Write ``results/<name>.json`` with the machine, date and load average added.

    Args:
        name: Benchmark name (file stem).
        payload: The measured numbers and their description.

    Returns:
        The written path.
    """
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    record = {
        "benchmark": name,
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine(),
        "load_average_at_end": load_average(),
        **payload,
    }
    path = RESULTS_DIR / f"{name}.json"
    path.write_text(json.dumps(record, indent=2, default=str) + "\n")
    print(f"wrote {path.relative_to(REPO_ROOT)}")
    return path


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]], title: str | None = None) -> str:
    """Render rows as a Markdown table (also readable in a terminal) and print it."""

    def cell(value: Any) -> str:
        if isinstance(value, float):
            return f"{value:.3g}" if abs(value) < 100 else f"{value:.0f}"
        return str(value)

    lines = []
    if title:
        lines += [f"**{title}**", ""]
    lines.append("| " + " | ".join(headers) + " |")
    lines.append("|" + "|".join("---" for _ in headers) + "|")
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    text = "\n".join(lines)
    print(text + "\n", flush=True)
    return text


@contextmanager
def timer() -> Iterator[Callable[[], float]]:
    """``with timer() as elapsed: ...; elapsed()`` -> seconds since the block started."""
    start = time.perf_counter()
    end: list[float] = []
    yield lambda: (end[0] if end else time.perf_counter()) - start
    end.append(time.perf_counter())


def pin_one_core() -> int | None:
    """Restrict this process to one CPU (the first allowed one); returns it, or None if the
    platform cannot pin. Benchmarks that report 'per core' numbers call this first."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        cpu = min(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cpu})
        return cpu
    except (AttributeError, OSError):
        return None


def matmul_peaks_gflops(size: int = 2048, reps: int = 5) -> dict[str, float]:
    """fp32 products of two ``size`` x ``size`` matrices on the current torch threads, the best
    of ``reps`` each, in GFLOP/s: ``torch.mm`` (MKL's sgemm in torch's CPU wheels) and oneDNN
    (``torch.ops.mkldnn._linear_pointwise``, the weight packed once). On AMD EPYC the first
    runs at less than half the second (measured ~95 vs ~220 on one thread); a share of the
    "peak" means a share of the larger."""
    import torch

    a, b = torch.randn(size, size), torch.randn(size, size)

    def best(run: Callable[[], Any]) -> float:
        run()
        fastest = float("inf")
        for _ in range(reps):
            start = time.perf_counter()
            run()
            fastest = min(fastest, time.perf_counter() - start)
        return 2 * size**3 / fastest / 1e9

    peaks = {"torch_mm": best(lambda: torch.mm(a, b))}
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(b.t().contiguous(), size)
        peaks["onednn"] = best(lambda: torch.ops.mkldnn._linear_pointwise(a, packed, None, "none", [], ""))
    except (AttributeError, RuntimeError):  # a torch without oneDNN
        pass
    return peaks


def matmul_peak_gflops(size: int = 2048, reps: int = 5) -> float:
    """The larger of :func:`matmul_peaks_gflops`: the machine's fp32 matmul peak as torch can reach it."""
    return max(matmul_peaks_gflops(size, reps).values())


def read_bandwidth_gbs(megabytes: int = 512, reps: int = 5) -> float:
    """Memory read bandwidth on the current torch threads: ``torch.sum`` over a float32 tensor
    of ``megabytes`` (far larger than any cache), the best of ``reps``, in GB/s."""
    import torch

    x = torch.ones(megabytes * (1 << 20) // 4)
    x.sum()
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - start)
    return x.numel() * 4 / best / 1e9
