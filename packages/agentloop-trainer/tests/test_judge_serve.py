"""``reward.judge`` against a real judge: ``agentloop serve`` on loopback with a tiny random
checkpoint, and the policy's own engine (``url=policy``).

The tiny model cannot grade, so these tests pin the plumbing, not the verdicts: greedy judge
replies are the server's own (the same text the stock ``openai`` client gets for the same
prompt), its ``usage`` becomes the cost, a reply without a score fails the judgement with the
reply in the reason, and ``failure_score`` is the explicit fallback a run trains with.
The README's "Judge rewards" command is :func:`test_three_grpo_steps_with_a_served_judge`.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import time

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from agentloop_trainer.cli import main  # noqa: E402
from agentloop_trainer.config import load_config  # noqa: E402
from agentloop_trainer.reward.judge import JudgeSettings  # noqa: E402
from agentloop_trainer.reward.judge_client import JudgeClient, JudgeFailed  # noqa: E402

KEY = "judge-s3cret"


@pytest.fixture(scope="module")
def served_judge(random_model_path, tmp_path_factory):
    """``agentloop serve CHECKPOINT --model-name judge --api-key-env JUDGE_KEY`` on a free
    loopback port; its ``/v1`` base URL."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = open(tmp_path_factory.mktemp("judge") / "serve.log", "w+")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(
        [sys.executable, "-m", "agentloop_trainer.cli.main", "serve", str(random_model_path), "--port", str(port),
         "--model-name", "judge", "--api-key-env", "JUDGE_KEY", "actor_rollout_ref.rollout.max_model_len=512"],
        env={**os.environ, "JUDGE_KEY": KEY}, stdout=log, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    try:
        while True:
            if proc.poll() is not None:
                log.seek(0)
                raise AssertionError(log.read())
            try:
                if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise AssertionError("agentloop serve did not start")
            time.sleep(0.5)
        yield f"{base}/v1"
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()


def _client(url: str, *overrides: str) -> JudgeClient:
    settings = JudgeSettings.from_section(load_config([
        "reward.judge.enable=true", f"reward.judge.url={url}", "reward.judge.model=judge",
        "reward.judge.api_key_env=JUDGE_KEY", "reward.judge.max_tokens=12", *overrides]).reward.judge)
    assert settings is not None
    return JudgeClient(settings)


def test_a_served_judge_replies_and_its_usage_is_the_cost(served_judge, monkeypatch):
    monkeypatch.setenv("JUDGE_KEY", KEY)
    prompt = "Grade: 2+2=4. Reply 'Score: N'."
    client = _client(served_judge, "reward.judge.retries=1")
    reply, prompt_tokens, completion_tokens = asyncio.run(client._call_http(prompt))
    direct = openai.OpenAI(base_url=served_judge, api_key=KEY).chat.completions.create(
        model="judge", messages=[{"role": "user", "content": prompt}], temperature=0, max_tokens=12)
    assert reply == direct.choices[0].message.content  # greedy: the server's own reply, whole
    assert direct.usage is not None
    assert (prompt_tokens, completion_tokens) == (direct.usage.prompt_tokens, direct.usage.completion_tokens)
    assert prompt_tokens > 0
    assert completion_tokens > 0

    # The tiny model writes no "Score: N": the judgement fails after the retry, the reply in the reason.
    with pytest.raises(JudgeFailed, match="failed after 2 attempt") as info:
        asyncio.run(client.judge(prompt, tokenizer=None))
    assert repr(reply[:300]) in str(info.value)
    cost = info.value.cost
    assert (cost.calls, cost.failed_calls, cost.failures) == (2, 2, 1)
    assert cost.prompt_tokens == 2 * prompt_tokens

    monkeypatch.setenv("JUDGE_KEY", "wrong")
    with pytest.raises(JudgeFailed, match="HTTP 401"):
        asyncio.run(_client(served_judge, "reward.judge.retries=0").judge(prompt, None))


def _train(tmp_path, name: str, *judge: str) -> list[dict]:
    args = [
        "train", "trainer.total_steps=3", "data.train_batch_size=2", "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.rollout.multi_turn.max_tokens_per_turn=12", "data.max_response_length=40",
        "data.train_size=32", "data.val_size=2", "trainer.val_before_train=false", "trainer.test_freq=0",
        "trainer.save_freq=0", "trainer.progress_bar=false", f"trainer.output_dir={tmp_path}",
        f"trainer.experiment_name={name}", "reward.judge.enable=true", "reward.judge.combine=add",
        "reward.judge.weight=0.5", "reward.judge.max_tokens=12", "reward.judge.retries=0",
        "reward.judge.failure_score=0", *judge,
    ]
    assert main(args) == 0
    lines = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
    return [m for m in map(json.loads, lines) if "actor/pg_loss" in m]


@pytest.mark.slow
def test_three_grpo_steps_with_a_served_judge(served_judge, random_model_path, tmp_path, monkeypatch):
    """The README's command: 3 GRPO steps, every trajectory judged by the served model."""
    monkeypatch.setenv("JUDGE_KEY", KEY)
    steps = _train(tmp_path, "judged", f"model.path={random_model_path}", f"reward.judge.url={served_judge}",
                   "reward.judge.model=judge", "reward.judge.api_key_env=JUDGE_KEY")
    assert [m["step"] for m in steps] == [1, 2, 3]
    for m in steps:
        assert m["rollout/num_failed"] == 0  # failure_score=0: unparsed verdicts score 0, counted
        assert m["judge/calls"] == 4  # 2 prompts x 2 samples, one attempt each
        assert m["judge/prompt_tokens"] > 0
        assert m["judge/completion_tokens"] > 0
        assert 0 <= m["judge/failures"] <= 4
        assert "agent_loop/reward/judge/mean" in m


@pytest.mark.slow
def test_the_policy_engine_judges_its_own_trajectories(random_model_path, tmp_path):
    steps = _train(tmp_path, "self_judged", f"model.path={random_model_path}", "reward.judge.url=policy",
                   "trainer.total_steps=1")
    assert [m["step"] for m in steps] == [1]
    assert steps[0]["judge/calls"] == 4
    assert steps[0]["judge/prompt_tokens"] > 0  # the rendered prompt, counted by the engine's tokenizer
    assert steps[0]["rollout/num_failed"] == 0
