"""`agentloop train` over already-running engine HTTP servers (`rollout.server_urls`): the
routing client balances the rollout over both replicas and pushes every update into both."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("httpx", reason='server_urls needs pip install "agentloop-engines[server]"')
pytest.importorskip("uvicorn", reason='the test servers need pip install "agentloop-engines[server]"')


class CountingServer:
    """An HFServer that counts the generate calls it served (the replica's own view)."""

    def __init__(self, inner):
        self.inner, self.calls = inner, 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    async def generate(self, *args, **kwargs):
        self.calls += 1
        return await self.inner.generate(*args, **kwargs)


@pytest.mark.slow
def test_train_rolls_out_on_two_http_replicas_and_syncs_both(random_model_path, tmp_path, monkeypatch):
    import torch

    from agentloop_engines.adapters.hf import HFServer
    from agentloop_engines.serving.server import ServerThread
    from agentloop_trainer.cli import main

    # The parity of the generated text's length: a random policy gets a learning signal.
    reward = tmp_path / "parity.py"
    reward.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                      "    return float(len(solution_str) % 2)\n")
    engines = [CountingServer(HFServer(str(random_model_path), seed=0)) for _ in range(2)]
    # Weight pushes need the servers' control key (the chat key would not do), read from the environment.
    monkeypatch.setenv("TEST_CONTROL_KEY", "remote-control-key")
    with ServerThread(engines[0], control_key="remote-control-key") as a, \
            ServerThread(engines[1], control_key="remote-control-key") as b:
        assert main([
            "train", f"model.path={random_model_path}", f"actor_rollout_ref.rollout.server_urls=[{a.url},{b.url}]",
            "actor_rollout_ref.rollout.server_control_key_env=TEST_CONTROL_KEY",
            "data.train_size=64", "data.val_size=4", "data.train_batch_size=4", "actor_rollout_ref.rollout.n=2",
            "actor_rollout_ref.rollout.multi_turn.max_tokens_per_turn=12", "data.max_response_length=40",
            "actor_rollout_ref.actor.lr=1e-2", "trainer.total_steps=2", "trainer.test_freq=0", "trainer.save_freq=2",
            "trainer.progress_bar=false", f"trainer.output_dir={tmp_path}", "trainer.experiment_name=remote",
            f"custom_reward_function.path={reward}",
        ]) == 0
    assert all(e.calls > 0 for e in engines), [e.calls for e in engines]  # both replicas served
    steps = [json.loads(line) for line in (tmp_path / "remote" / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps if "actor/pg_loss" in s] == [1, 2]
    # Both remote engines hold exactly the trained policy: the last update reached each of them.
    from safetensors.torch import load_file

    trained = load_file(tmp_path / "remote" / "checkpoints" / "step_2" / "hf" / "model.safetensors")
    from transformers import AutoModelForCausalLM

    original = AutoModelForCausalLM.from_pretrained(random_model_path).state_dict()
    assert any(not torch.equal(original[k], trained[k]) for k in trained), "training changed nothing"
    for engine in engines:
        served = engine.inner.model.state_dict()
        for name, value in trained.items():
            torch.testing.assert_close(served[name].float(), value.float(), rtol=0, atol=0)


def test_an_evaluation_over_http_leaves_no_finished_trajectory_in_the_remote_cache(random_model_path):
    """The worker tells the remote server when each trajectory ends (``POST /forget_session``),
    and closing the rollout sends the last ids before its event loop ends: the server's prefix
    cache holds nothing of the finished evaluation."""
    from agentloop_engines.adapters.hf import HFServer
    from agentloop_engines.serving.server import ServerThread
    from agentloop_trainer.config.loading import load_config
    from agentloop_trainer.stages.rollout_setup import evaluate_checkpoint

    engine = HFServer(str(random_model_path), seed=0)
    with ServerThread(engine) as thread:
        cfg = load_config([f"model.path={random_model_path}", f"actor_rollout_ref.rollout.server_urls=[{thread.url}]",
                           "data.val_size=6", "actor_rollout_ref.rollout.multi_turn.max_tokens_per_turn=8",
                           "data.max_response_length=24", "trainer.progress_bar=false"])
        result = evaluate_checkpoint(cfg, random_model_path)
    assert result.n == 6
    assert engine.prefix_cache is not None
    assert engine.stats["prefix_cache_forgotten"] >= 6  # one entry per trajectory at least, each dropped
    assert len(engine.prefix_cache) == 0
