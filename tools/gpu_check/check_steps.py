"""The GPU check's steps (b) to (f) as commands, each with its budget and its reader of key
numbers. Step (a), the environment probe, runs first on its own: whether CUDA is there decides
whether these run at all (tools/gpu_check/run.py)."""

from __future__ import annotations

import json
import os
import re
import shlex
import xml.etree.ElementTree as ElementTree
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from install_packages import python_path
from step_runner import Step

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]

BUDGETS_S = {"env": 60.0, "install": 90.0, "gpu_tests": 90.0, "hf_vs_generate": 60.0, "main_job": 150.0,
             "real_model": 150.0}
"""Each step's own wall-clock budget. They add up to more than the check's total on purpose: a
step that finishes early leaves its time to the later ones, and the total (run.py TOTAL_S) caps
the sum so one device call of 9 minutes always gets its result file back."""

STEP_ENV = {"TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1",
            "RAY_AUTH_MODE": "disabled", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "MLFLOW_DISABLE_TELEMETRY": "true"}
"""What the test sessions set (noxfile TEST_ENV), less OMP_NUM_THREADS: the device has 16 cores."""

MAIN_JOB_OVERRIDES = (
    "trainer.total_steps=3", "sft.steps=100", "sft.max_steps=100", "sft.warmup_steps=10", "data.val_size=16",
    "trainer.test_freq=0", "trainer.save_freq=0", "trainer.progress_bar=false",
)
"""The main job (``nox -s train``) cut to a few steps: a 100-step SFT warm-up instead of up to
1500 (it need not learn: the step checks the pipeline on CUDA, not the accuracy), 3 GRPO steps
at the default batch (16 prompts x 8 samples), 16 held-out problems before and after."""

REAL_MODEL_OVERRIDES = (
    "trainer.total_steps=2", "sft.total_steps=2", "sft.warmup_steps=1", "data.val_size=8", "data.train_batch_size=4",
    "actor_rollout_ref.rollout.n=4", "trainer.test_freq=0", "trainer.save_freq=0", "trainer.save_hf=false",
    "trainer.progress_bar=false",
)
"""examples/trainer/smollm2_calculator.yaml (``nox -s train-real``) cut to 2 SFT steps, 2 GRPO
steps of 4 prompts x 4 samples and 8 held-out problems."""
REAL_MODEL_SFT_ROWS = 32
"""Demonstrations written for the real-model step's SFT (2 steps of the recipe's batch of 16)."""


@dataclass(frozen=True)
class Plan:
    """Where and how the steps run."""

    python: str
    """The interpreter every step runs under (the one the check itself runs under)."""
    work: Path
    """A scratch folder: installs, runs, logs."""
    wheels: Path
    """The carried wheels (tools/gpu_check/prepare.sh)."""
    device: str = "cuda"
    """The torch device the steps use (``cpu`` only for a dry run of the check's own logic)."""
    model: Path | None = None
    """A real checkpoint for step (f): a converted Hugging Face folder or a GGUF file."""

    @property
    def site(self) -> Path:
        return self.work / "site"

    @property
    def editable(self) -> Path:
        return self.work / "editable"

    def env(self) -> dict[str, str]:
        """The environment of the steps after the install: the installed packages first."""
        paths = [*python_path(self.site, self.editable), os.environ.get("PYTHONPATH", "")]
        return {**STEP_ENV, "PYTHONPATH": os.pathsep.join(p for p in paths if p)}


def gpu_test_files(root: Path = ROOT) -> list[Path]:
    """Every test module of our packages that holds a ``gpu``-marked test. Only these are
    collected: the others import extras (Ray, MLflow, MCP, LangGraph) the device lacks, and
    ``-m gpu`` would deselect all their tests anyway."""
    return sorted(p for p in root.glob("packages/*/tests/**/test_*.py")
                  if re.search(r"pytest\.mark\.gpu\b", p.read_text(encoding="utf-8")))


def junit_counts(xml_path: Path) -> dict[str, Any]:
    """Test counts from pytest's JUnit XML, with the ids of failed and errored tests."""
    if not xml_path.exists():
        return {"junit": f"{xml_path} was not written (pytest did not get to its report)"}
    tree = ElementTree.parse(xml_path)
    counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    for suite in tree.iter("testsuite"):
        for key in counts:
            counts[key] += int(suite.get(key, 0))
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    failed = []
    skipped = []
    for case in tree.iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        if case.find("failure") is not None or case.find("error") is not None:
            failed.append(name)
        skip = case.find("skipped")
        if skip is not None:
            skipped.append(f"{name}: {skip.get('message', '')}"[:300])
    return {**counts, "failed": failed, "skip_reasons": skipped}


def _some_test_ran(numbers: dict[str, Any]) -> str | None:
    """On CUDA at least one gpu test must run: all of them skipping is a failure, not a pass."""
    if numbers.get("passed", 0) > 0:
        return None
    return f"no gpu-marked test ran on CUDA ({numbers.get('skipped', 0)} skipped: see numbers.skip_reasons)"


def run_summary(output_dir: Path) -> dict[str, Any]:
    """The scalar entries of the newest run's summary.json under ``output_dir``."""
    summaries = sorted(output_dir.glob("*/summary.json"), key=lambda p: p.stat().st_mtime)
    if not summaries:
        return {"summary": f"no */summary.json under {output_dir}: the run did not finish"}
    summary = json.loads(summaries[-1].read_text(encoding="utf-8"))
    scalars = {k: v for k, v in summary.items() if isinstance(v, (int, float, str, bool)) or v is None}
    return {"run_dir": str(summaries[-1].parent), **scalars}


def _train(plan: Plan, *args: str) -> list[str]:
    """``agentloop train ARGS`` through this interpreter (no console script on PATH needed)."""
    code = "import sys; from agentloop_trainer.cli import main; sys.exit(main(sys.argv[1:]))"
    return [plan.python, "-c", code, *args]


def install_step(plan: Plan) -> Step:
    return Step("install", "(b) carried wheels into a scratch site; our packages editable, no deps, no build isolation",
                [plan.python, str(HERE / "install_packages.py"), "--wheels", str(plan.wheels), "--site", str(plan.site),
                 "--editable", str(plan.editable)], BUDGETS_S["install"], env=STEP_ENV, cwd=ROOT)


def gpu_tests_step(plan: Plan) -> Step:
    files = gpu_test_files()
    xml_path = plan.work / "gpu_tests.xml"
    # No plugin autoload: the device image's own pytest plugins are not what CI runs (and with
    # filterwarnings=error one that warns at import fails every test); asyncio is loaded by name.
    argv = [plan.python, "-m", "pytest", *map(str, files), "-m", "gpu", "-q", "-rA", "-p", "no:cacheprovider",
            "-p", "pytest_asyncio.plugin", f"--junitxml={xml_path}"]
    return Step("gpu_tests", "(c) the gpu-marked tests of our packages (nox -s gpu)", argv, BUDGETS_S["gpu_tests"],
                env={**plan.env(), "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}, cwd=ROOT,
                skip=None if files else "no test module under packages/*/tests holds a pytest.mark.gpu test",
                parse=lambda _output: junit_counts(xml_path), check=_some_test_ran if plan.device == "cuda" else None)


def hf_vs_generate_step(plan: Plan) -> Step:
    return Step("hf_vs_generate", f"(d) HFServer on {plan.device} against plain transformers generate (tiny model)",
                [plan.python, str(HERE / "hf_vs_generate.py"), "--device", plan.device],
                BUDGETS_S["hf_vs_generate"], env=plan.env(), cwd=plan.work)


def main_job_step(plan: Plan) -> Step:
    out = plan.work / "runs" / "main"
    argv = _train(plan, "train", f"trainer.device={plan.device}", f"trainer.output_dir={out}", *MAIN_JOB_OVERRIDES)
    return Step("main_job", f"(e) the main job (nox -s train) for a few steps with trainer.device={plan.device}",
                argv, BUDGETS_S["main_job"], env=plan.env(), cwd=plan.work, parse=lambda _output: run_summary(out))


def real_model_step(plan: Plan) -> Step:
    title = f"(f) the real-model recipe (examples/trainer/smollm2_calculator.yaml) with trainer.device={plan.device}"
    if plan.model is None:
        return Step("real_model", title, budget_s=BUDGETS_S["real_model"], skip=(
            "no real checkpoint given (--model DIR_OR_GGUF): none can be fetched on the device, and SmolLM2-135M "
            "(538 MB converted, 93 MB as GGUF) is over the 64 MiB a device call carries"))
    if not plan.model.exists():
        return Step("real_model", title, budget_s=BUDGETS_S["real_model"],
                    skip=f"--model {plan.model} does not exist on this machine")
    work = plan.work / "real"
    data = work / "calculator_sft.parquet"
    out = work / "runs"
    commands = []
    model_dir = plan.model
    if plan.model.is_file():  # a GGUF: convert it first (agentloop model convert)
        model_dir = work / "hf"
        commands.append(_train(plan, "model", "convert", str(plan.model), "--out", str(model_dir)))
    # Seed 1: the GRPO training split's seed, as `nox -s train-real` writes its demonstrations.
    commands.append(_train(plan, "data", "calculator-sft", "--out", str(data), "--n", str(REAL_MODEL_SFT_ROWS),
                           "--seed", "1", "--flip-prob", "0.6"))
    commands.append(_train(plan, "train", "--config", str(ROOT / "examples" / "trainer" / "smollm2_calculator.yaml"),
                           f"model.path={model_dir}", f"sft.train_files={data}", f"trainer.device={plan.device}",
                           f"trainer.output_dir={out}", *REAL_MODEL_OVERRIDES))
    script = f"mkdir -p {shlex.quote(str(work))} && " + " && ".join(shlex.join(c) for c in commands)
    return Step("real_model", title, ["bash", "-c", script], BUDGETS_S["real_model"], env=plan.env(),
                cwd=plan.work, parse=lambda _output: {"model": str(plan.model), **run_summary(out)})


def later_steps(plan: Plan) -> list[Step]:
    """Steps (b) to (f), in the order they run."""
    return [install_step(plan), gpu_tests_step(plan), hf_vs_generate_step(plan), main_job_step(plan),
            real_model_step(plan)]
