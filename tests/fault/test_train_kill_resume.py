"""Training faults: SIGKILL a running `agentloop train` mid-run, then `--resume` it; the resumed
run must reach the same per-step numbers as a run that was never interrupted."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

pytest.importorskip("agentloop_trainer.cli", reason="agentloop-trainer is not installed")
pytest.importorskip("torch", reason="training needs torch")

# The `agentloop` command. A random policy never writes "#### N", so a custom reward function
# scores the parity of the generated text's length instead; advantages (and so the update)
# then depend on exactly what was sampled, which is what resume must reproduce.
TRAIN = textwrap.dedent('''
    import sys
    from agentloop_trainer.cli import main
    sys.exit(main(sys.argv[1:]))
''')
PARITY = "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n" \
         "    return float(len(solution_str) % 2)\n"


def _args(model_path: Path, out: Path, name: str) -> list[str]:
    reward = out / "parity.py"
    if not reward.exists():
        out.mkdir(parents=True, exist_ok=True)
        reward.write_text(PARITY)
    return [
        "train", f"custom_reward_function.path={reward}", f"model.path={model_path}", "trainer.total_steps=4", f"trainer.output_dir={out}",
        f"trainer.experiment_name={name}", "trainer.test_freq=0", "trainer.save_freq=2", "trainer.progress_bar=false",
        "data.train_size=64", "data.val_size=2", "data.train_batch_size=2", "actor_rollout_ref.rollout.n=3",
        "actor_rollout_ref.rollout.multi_turn.max_tokens_per_turn=12", "data.max_response_length=40",
        "actor_rollout_ref.actor.lr=1e-2",
    ]


def _steps(run_dir: Path) -> dict[int, dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {r["step"]: r for r in rows if "actor/pg_loss" in r}


@pytest.fixture(scope="module")
def random_policy(tmp_path_factory):
    from agentloop_core.testing import load_tiny_tokenizer
    from agentloop_trainer.policy import TinyModelConfig, build_tiny_policy

    # A checkpoint folder as users have them: weights plus the tokenizer with its chat template.
    path = tmp_path_factory.mktemp("policy")
    tokenizer = load_tiny_tokenizer()
    build_tiny_policy(tokenizer, seed=0, spec=TinyModelConfig(hidden_size=64, num_attention_heads=4, intermediate_size=128)).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.mark.slow
def test_sigkill_mid_run_then_resume_matches_uninterrupted(tmp_path, random_policy):
    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    full = subprocess.run([sys.executable, str(script), *_args(random_policy, tmp_path, "full")],
                          capture_output=True, text=True, timeout=600)
    assert full.returncode == 0, full.stderr[-3000:]

    run_dir = tmp_path / "cut"
    proc = subprocess.Popen([sys.executable, str(script), *_args(random_policy, tmp_path, "cut")],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    latest = run_dir / "checkpoints" / "latest"
    deadline = time.monotonic() + 600
    # Kill as soon as the step-2 checkpoint is complete: the process is then inside step 3.
    while not (latest.exists() and "step_2" in latest.read_text()):
        assert proc.poll() is None, "the run ended before it could be killed"
        assert time.monotonic() < deadline, "no step-2 checkpoint within 10 minutes"
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    assert 4 not in _steps(run_dir), "the run was killed too late to test anything"

    resumed = subprocess.run([sys.executable, str(script), *_args(random_policy, tmp_path, "cut"), "--resume"],
                             capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    want, got = _steps(tmp_path / "full"), _steps(run_dir)
    assert sorted(want) == [1, 2, 3, 4]
    assert {3, 4} <= set(got)
    assert want[4]["actor/grad_norm"] > 1e-4, "the check needs a non-trivial gradient to mean anything"
    for step in (3, 4):
        assert got[step]["reward/mean"] == want[step]["reward/mean"], f"step {step} sampled different data"
        assert got[step]["actor/pg_loss"] == pytest.approx(want[step]["actor/pg_loss"], abs=1e-6)
        assert got[step]["actor/grad_norm"] == pytest.approx(want[step]["actor/grad_norm"], rel=1e-5)
