"""A third party's engine trains without agentloop naming it: the package in
``tests/third_party_engine`` (its own ``pyproject.toml`` declaring ``agentloop.engines`` entry
points) is pip-installed into a temporary folder and ``agentloop train`` runs on it with
``actor_rollout_ref.rollout.name=counting_hf`` in a subprocess that has the folder on its path.

A failure here with the built-in engines still working means the trainer selects behaviour by
an engine's name somewhere (grep its source for "hf"), or reads a capability the plug-in record
does not declare.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

THIRD_PARTY = Path(__file__).parent / "third_party_engine"


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """The folder the package is installed into (offline: no index, no build isolation)."""
    pytest.importorskip("setuptools", reason="building the test's engine package needs setuptools in the venv")
    # A copy: a setuptools build writes build/ and *.egg-info next to the sources.
    source = shutil.copytree(THIRD_PARTY, tmp_path_factory.mktemp("source") / "third_party_engine")
    target = tmp_path_factory.mktemp("site")
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index",
                           "--quiet", "--target", str(target), str(source)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return target


@pytest.fixture
def on_path(installed, monkeypatch):
    """The installed package importable (and its entry points visible) in this process; the
    engine registry forgets it afterwards."""
    from agentloop_core import engine_registry

    monkeypatch.syspath_prepend(str(installed))
    registry, broken = dict(engine_registry._REGISTRY), dict(engine_registry._BROKEN)
    yield installed
    for state, saved in ((engine_registry._REGISTRY, registry), (engine_registry._BROKEN, broken)):
        state.clear()
        state.update(saved)
    for name in [m for m in sys.modules if m == "counting_engine" or m.startswith("counting_engine.")]:
        del sys.modules[name]


def _agentloop(*args: str, site: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    """``agentloop ...`` as a user runs it, with ``site`` on PYTHONPATH."""
    script = Path(sys.executable).with_name("agentloop")
    cmd = [str(script)] if script.exists() else [
        sys.executable, "-c", "import sys; from agentloop_trainer.cli import main; sys.exit(main(sys.argv[1:]))"]
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH", "")) if p)}
    return subprocess.run([*cmd, *args], env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
def test_agentloop_train_runs_two_grpo_steps_on_a_third_party_engine(installed, random_model_path, tmp_path):
    """Two GRPO steps finish, every rollout request was served by the plug-in's engine (its log
    has each request; none were served elsewhere, since only it was built), and each update's
    weights reached it through ``update_weights`` (its plug-in declares no policy copy)."""
    served = tmp_path / "served.jsonl"
    proc = _agentloop(
        "train", f"model.path={random_model_path}", "trainer.total_steps=2", f"trainer.output_dir={tmp_path}",
        "trainer.experiment_name=plugin", "trainer.test_freq=0", "trainer.save_freq=0", "trainer.progress_bar=false",
        "trainer.val_before_train=false", "data.train_size=32", "data.val_size=2", "data.train_batch_size=2",
        "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.rollout.multi_turn.max_tokens_per_turn=12",
        "data.max_response_length=40", "actor_rollout_ref.rollout.name=counting_hf",
        f"+actor_rollout_ref.rollout.engine_kwargs.counting_hf.requests_log={served}",
        site=installed)
    assert proc.returncode == 0, proc.stderr[-4000:]
    run = tmp_path / "plugin"
    assert json.loads((run / "summary.json").read_text())["steps"] == 2
    steps = [m for m in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "actor/pg_loss" in m]
    assert [m["step"] for m in steps] == [1, 2]
    assert all(m["rollout/num_failed"] == 0 for m in steps), steps

    calls = [json.loads(line) for line in served.read_text().splitlines()]
    generated = [c for c in calls if c[0] == "generate"]
    assert len({c[1] for c in generated}) >= 2 * 2 * 2  # steps x prompts x samples, each its own trajectory
    # Every token the trainer trained on came from this engine (the response budget may cut some).
    assert sum(c[3] for c in generated) >= sum(m["rollout/generated_tokens"] for m in steps) > 0
    updates = [c for c in calls if c[0] == "update_weights"]
    assert len(updates) == 2, updates
    assert all(n > 0 for _, n in updates), updates


def test_a_missing_factory_names_its_install_line_and_an_unknown_name_lists_the_installed(on_path):
    from agentloop_core.engine_registry import EngineImportError
    from agentloop_trainer.config import ConfigError, load_config
    from agentloop_trainer.rollout import build_engine
    from agentloop_trainer.stages.rollout_setup import engine_config

    cfg = load_config(["actor_rollout_ref.rollout.name=counting_gpu"])  # declared: the config is fine
    with pytest.raises(EngineImportError, match=r"rollout.name=counting_gpu: engine 'counting_gpu' "
                                                r"\(counting_engine.gpu:build\): ModuleNotFoundError: .*"
                                                r"install it with: pip install \"agentloop-counting-engine\[gpu\]\""):
        build_engine(engine_config(cfg, "/m"))
    with pytest.raises(ConfigError) as info:
        load_config(["actor_rollout_ref.rollout.name=counting"])
    assert "installed engines: counting_gpu, counting_hf, hf, sglang, vllm" in str(info.value)
    assert "'agentloop.engines'" in str(info.value)
    # What the trainer asks of the plug-in, not of its name: no partial rollout, float32 only.
    with pytest.raises(ConfigError, match="partial_rollout .*not counting_hf"):
        load_config(["actor_rollout_ref.rollout.name=counting_hf", "trainer.mode=async"])
    with pytest.raises(ConfigError, match="rollout.dtype must be float32 or null with rollout.name=counting_hf"):
        load_config(["actor_rollout_ref.rollout.name=counting_hf", "actor_rollout_ref.rollout.dtype=bfloat16"])
    cfg = load_config(["actor_rollout_ref.rollout.name=counting_hf", "+actor_rollout_ref.rollout.engine_kwargs."
                       "counting_hf.requests_log=/dev/null"])
    assert engine_config(cfg, "/m").engine_kwargs == {"requests_log": "/dev/null"}  # its section is a valid one
