"""``agentloop serve`` puts a checkpoint behind the OpenAI-compatible gateway: a stock ``openai``
client chats with it, lists it, and a session records the exact tokens."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_a_checkpoint_to_the_openai_client(random_model_path):
    port = _free_port()
    env = {**os.environ, "MY_KEY": "s3cret"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "agentloop_trainer.cli", "serve", str(random_model_path), "--port", str(port),
         "--api-key-env", "MY_KEY", "--model-name", "tiny", "actor_rollout_ref.rollout.max_model_len=256"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.stdout.read()
            try:
                if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "server did not start"
            time.sleep(0.5)
        client = openai.OpenAI(base_url=f"{base}/sessions/s1/v1", api_key="s3cret")
        assert [m.id for m in client.models.list().data] == ["tiny"]
        reply = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}],
                                               max_tokens=5, temperature=0)
        assert reply.choices[0].finish_reason in ("stop", "length")
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{base}/v1", api_key="wrong").models.list()
        recorded = httpx.delete(f"{base}/sessions/s1", headers={"Authorization": "Bearer s3cret"}).json()
        assert recorded["num_calls"] == 1
        call = recorded["calls"][0]
        # The ids the client saw in the extension field are the ones recorded for training.
        assert call["token_ids"] == reply.choices[0].model_extra["token_ids"]
        assert 0 < len(call["token_ids"]) <= 5 and len(call["log_probs"]) == len(call["token_ids"])
    finally:
        proc.terminate()
        proc.wait(timeout=30)
