"""``trainer.logger``: the config key as verl spells it, and a real 2-step run whose W&B offline
files and TensorBoard events, read back with each tool's own reader, hold the values of
``metrics.jsonl`` and the step's trajectories; MLflow's metrics and artifacts likewise.

No network: W&B runs offline (``WANDB_MODE=offline``), with its data, cache and config folders
in the test's temporary folder; MLflow tracks to a SQLite file there."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from agentloop_trainer.config import ConfigError, load_config
from agentloop_trainer.loggers import Tracking, active_loggers, scalar_metrics


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _same(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-6)  # TensorBoard keeps float32


# -- the config key ---------------------------------------------------------------------------


@pytest.mark.parametrize("value", ["[console,wandb,tensorboard]", "console,wandb,tensorboard",
                                   "['console','wandb','tensorboard']"])
def test_logger_key_takes_verls_list_and_a_comma_string(value):
    notices: list[str] = []
    cfg = load_config([f"trainer.logger={value}"], notice=notices.append)
    assert list(cfg.trainer.logger) == ["console", "wandb", "tensorboard"]
    assert not [n for n in notices if "trainer.logger" in n]  # a real key now, not ignored with a notice
    # metrics.jsonl is always written, first
    assert active_loggers(cfg.trainer) == ["jsonl", "console", "wandb", "tensorboard"]


def test_logger_key_defaults_and_mlflow_uri_turns_on_mlflow():
    assert active_loggers(load_config([]).trainer) == ["jsonl", "console"]
    cfg = load_config(["trainer.logger=console", "trainer.mlflow_tracking_uri=sqlite:///x.db"])
    assert active_loggers(cfg.trainer) == ["jsonl", "console", "mlflow"]


def test_unknown_logger_and_bad_wandb_mode_are_config_errors():
    with pytest.raises(ConfigError, match=r"unknown logger 'wanb'; the loggers are console, jsonl, mlflow, wandb"):
        load_config(["trainer.logger=[console,wanb]"])
    with pytest.raises(ConfigError, match="trainer.wandb_mode must be null or one of"):
        load_config(["trainer.logger=wandb", "trainer.wandb_mode=offline_please"])


@pytest.mark.parametrize(("module", "key", "extra"), [
    ("wandb", "trainer.logger=[console,wandb]", "wandb"),
    ("tensorboard", "trainer.logger=tensorboard", "tensorboard"),
    ("mlflow", "trainer.mlflow_tracking_uri=sqlite:///x.db", "mlflow"),
])
def test_missing_package_names_the_extra_at_config_load(monkeypatch, module, key, extra):
    monkeypatch.setitem(sys.modules, module, None)  # what an uninstalled package looks like to find_spec
    with pytest.raises(ConfigError, match=rf"not installed: pip install 'agentloop-trainer\[{extra}\]'"):
        load_config([key])


# -- a real run ---------------------------------------------------------------------------------


@pytest.fixture
def offline_wandb(tmp_path, monkeypatch):
    """W&B offline, its folders in ``tmp_path``, quiet."""
    for var, sub in {"WANDB_DATA_DIR": "data", "WANDB_CACHE_DIR": "cache", "WANDB_CONFIG_DIR": "config",
                     "WANDB_ARTIFACT_DIR": "artifacts"}.items():
        monkeypatch.setenv(var, str(tmp_path / "wandb_home" / sub))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_ERROR_REPORTING", "false")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)


def _wandb_records(run_dir: Path) -> list[dict]:
    """The records of the run's ``.wandb`` file, as W&B's own reader prints them."""
    (run_file,) = run_dir.glob("wandb/offline-run-*/run-*.wandb")
    out = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(run_file)],
                         capture_output=True, text=True, timeout=120, check=True, env=os.environ.copy())
    return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]


def _child_processes() -> list[str]:
    me = str(os.getpid())
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[1] == me:  # the parent pid
            found.append((stat.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"))
    return found


def test_two_step_run_wandb_and_tensorboard_hold_metrics_jsonl(tmp_path, random_model_path, offline_wandb):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from agentloop_trainer.cli import run_train

    logged: list[str] = []
    cfg = load_config([
        f"model.path={random_model_path}", f"trainer.run_dir={tmp_path / 'run'}", "trainer.total_steps=2",
        "trainer.progress_bar=false", "trainer.test_freq=0", "trainer.save_freq=0", "trainer.save_hf=false",
        "data.train_size=16", "data.val_size=2", "data.train_batch_size=2", "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.rollout.multi_turn.max_tokens_per_turn=8", "data.max_response_length=24",
        "trainer.log_trajectories_per_step=2", "trainer.logger=[console,wandb,tensorboard]",
        "trainer.project_name=loggers-test",
    ])
    run_dir, _ = run_train(cfg, log=logged.append)
    records = _jsonl(run_dir / "metrics.jsonl")
    steps = [r for r in records if "reward/mean" in r]
    assert [r["step"] for r in steps] == [1, 2]
    assert sum(line.startswith("step ") and "| reward " in line for line in logged) == 2  # the console logger
    assert not [c for c in _child_processes() if "wandb" in c]  # wandb's service stopped with the run

    # What each backend must hold: every finite number of every record, at its step (W&B merges
    # the records of one step, the evaluation after the last step into that step's row).
    expected: dict[int, dict[str, float]] = {}
    for r in records:
        expected.setdefault(r["step"], {}).update(scalar_metrics(r))
    assert {"reward/mean", "actor/pg_loss", "timing_s/generate"} <= expected[2].keys()

    # W&B: the offline run's history rows and the trajectory tables.
    wb = _wandb_records(run_dir)
    run = next(r["run"] for r in wb if r["type"] == "run")
    assert run["project"] == "loggers-test"
    assert run["display_name"] == run_dir.name
    assert run["config"]["update"]["trainer"]["logger"] == ["console", "wandb", "tensorboard"]
    history = {h["history"]["step"].get("num", 0): h["history"]["item"] for h in wb if h["type"] == "history"}
    assert sorted(history) == sorted(expected) == [0, 1, 2]
    for step, values in expected.items():
        for key, value in values.items():
            assert _same(history[step][key], value), (step, key, history[step][key], value)
    for step in (1, 2):
        row_of_step = history[step]  # the reader prints a logged object's fields as dotted keys
        assert row_of_step["trajectories._type"] == "table-file"
        (table_file,) = run_dir.glob(f"wandb/offline-run-*/files/{row_of_step['trajectories.path']}")
        table = json.loads(table_file.read_text())
        jsonl_rows = _jsonl(run_dir / "trajectories" / f"step_{step}.jsonl")
        assert len(table["data"]) == len(jsonl_rows) >= 2
        col = {c: i for i, c in enumerate(table["columns"])}
        for row, rec in zip(table["data"], jsonl_rows, strict=True):
            assert row[col["step"]] == step
            assert _same(row[col["reward"]], rec["reward"])
            assert row[col["num_turns"]] == rec["num_turns"] >= 1
            assert row[col["response"]] == "".join(rec["response_tokens"])
            assert row[col["prompt"]] == "".join(rec["prompt_tokens"])

    # TensorBoard: the scalars and the trajectories' text, read by TensorBoard's own loader.
    acc = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    for step, values in expected.items():
        for key, value in values.items():
            events = [e for e in acc.Scalars(key) if e.step == step]
            assert len(events) == 1, (step, key, events)
            assert _same(events[0].value, value), (step, key, events[0].value, value)
    text = acc.Tensors("trajectories/text_summary")
    assert [e.step for e in text] == [1, 2]
    assert "**trajectory 0**" in text[0].tensor_proto.string_val[0].decode()


def test_mlflow_logger_keeps_metrics_trajectories_and_the_curve(tmp_path):
    from mlflow.tracking import MlflowClient

    from agentloop_trainer.view.metrics import plot_reward_curve

    cfg = load_config(["trainer.logger=[mlflow]", f"trainer.mlflow_tracking_uri=sqlite:///{tmp_path / 'ml.db'}",
                       "trainer.project_name=loggers-ml"])
    run_dir = tmp_path / "run"
    tracking = Tracking.from_config(cfg.trainer, run_dir, log=lambda _: None)
    history = [{"step": 0, "eval/accuracy": 0.25}, {"step": 1, "reward/mean": 0.5, "actor/pg_loss": -0.125,
                                                   "flag": True, "note": "x", "bad": float("nan")}]
    tracking.log_trajectories([{"step": 1, "trajectory_index": 0, "reward": 1.0, "num_turns": 2,
                                "prompt_tokens": ["2+2", "?"], "response_tokens": ["####", " 4"]}], step=1)
    for record in history:
        tracking.log(record, step=record["step"])
    tracking.log_artifact(plot_reward_curve(history, run_dir / "reward_curve.png"))
    tracking.close()

    assert _jsonl(run_dir / "metrics.jsonl")[1]["note"] == "x"  # jsonl is always there, whole
    client = MlflowClient(f"sqlite:///{tmp_path / 'ml.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("loggers-ml").experiment_id])
    assert run.info.run_name == "run"
    assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "reward_mean")] == [(1, 0.5)]
    assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "eval_accuracy")] == [(0, 0.25)]
    assert set(run.data.metrics) == {"reward_mean", "actor_pg_loss", "eval_accuracy"}  # no bool, str or NaN
    artifacts = Path(client.download_artifacts(run.info.run_id, "", str(tmp_path / "dl")))
    (row,) = json.loads((artifacts / "trajectories" / "step_1.json").read_text())
    assert (row["reward"], row["num_turns"], row["prompt"], row["response"]) == (1.0, 2, "2+2?", "#### 4")
    assert (artifacts / "reward_curve.png").stat().st_size > 1000
