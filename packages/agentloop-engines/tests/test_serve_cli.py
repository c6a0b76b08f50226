"""``agentloop-serve`` (:mod:`agentloop_engines.cli`) serves a checkpoint with agentloop-engines
alone: a stock ``openai`` client chats with it and a session records the exact tokens, in a
process where ``agentloop_trainer`` cannot be imported; ``--server-url`` routes over an engine
server that already runs. If one fails, run the command it prints by hand and read its output."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

import pytest

from agentloop_engines.cli import build_parser, engine_arguments, main, read_serve_keys

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from agentloop_engines.testing.serve_process import start_server  # noqa: E402  (it needs httpx)

CONTROL = "c0ntrol-s3cret"
CONTROL_AUTH = {"Authorization": f"Bearer {CONTROL}"}

# The serving process refuses to import the trainer, as on a machine with core + engines only.
WITHOUT_TRAINER = """
import sys

class NoTrainer:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] == "agentloop_trainer":
            raise ModuleNotFoundError("agentloop_trainer is not installed in this process")
        return None

sys.meta_path.insert(0, NoTrainer())
from agentloop_engines.cli import main
sys.exit(main(sys.argv[1:]))
"""


def _serve(*args: str) -> tuple[subprocess.Popen, str]:
    """Start ``agentloop-serve ARGS`` (without the trainer) and wait until it answers /health."""
    return start_server([sys.executable, "-c", WITHOUT_TRAINER, *args],
                        {**os.environ, "MY_KEY": "s3cret", "MY_CONTROL": CONTROL}, f"agentloop-serve {' '.join(args)}")


def _stop(proc: subprocess.Popen) -> str:
    proc.terminate()
    out, _ = proc.communicate(timeout=30)
    return out


def _chat_in_a_session(base: str) -> None:
    """One chat call in session ``s1``: the ids the client saw are the ones recorded."""
    r = httpx.post(f"{base}/sessions/s1", headers=CONTROL_AUTH)
    assert r.status_code == 200, r.text
    client = openai.OpenAI(base_url=base + r.json()["base_url"], api_key="s3cret")
    assert [m.id for m in client.models.list().data] == ["tiny"]
    reply = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}],
                                           max_tokens=5, temperature=0)
    recorded = httpx.delete(f"{base}/sessions/s1", headers=CONTROL_AUTH).json()
    assert recorded["num_calls"] == 1
    call = recorded["calls"][0]
    assert call["token_ids"] == reply.choices[0].model_extra["token_ids"]
    assert 0 < len(call["token_ids"]) <= 5
    assert len(call["log_probs"]) == len(call["token_ids"])


def test_serves_a_checkpoint_without_the_trainer(model_path):
    pytest.importorskip("transformers")
    proc, base = _serve(str(model_path), "--api-key-env", "MY_KEY", "--control-key-env", "MY_CONTROL",
                        "--model-name", "tiny", "--max-model-len", "256", "--engine-arg", "max_batch_size=4")
    try:
        _chat_in_a_session(base)
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{base}/v1", api_key="wrong").models.list()
    finally:
        out = _stop(proc)
    assert f"serving {model_path} (hf) at {base}/v1" in out
    assert CONTROL not in out  # where the key lives is printed, never the key


def test_routes_over_running_engine_servers(model_path):
    pytest.importorskip("transformers")
    from agentloop_engines.adapters.hf import HFServer
    from agentloop_engines.serving.server import ServerThread

    with ServerThread(HFServer(str(model_path), max_model_len=256)) as upstream:
        proc, base = _serve(str(model_path), "--server-url", upstream.url, "--server-url", upstream.url,
                            "--control-key-env", "MY_CONTROL", "--model-name", "tiny")
        try:
            _chat_in_a_session(base)
        finally:
            out = _stop(proc)
    assert f"serving {model_path} (2 replicas)" in out


def test_list_engines_names_the_installed_plugins(capsys):
    assert main(["--list-engines"]) == 0
    assert {"hf", "vllm", "sglang"} <= set(capsys.readouterr().out.split())


def test_an_unknown_engine_is_named_before_serving(model_path, capsys):
    pytest.importorskip("transformers")
    assert main([str(model_path), "--engine", "nope"]) == 2
    err = capsys.readouterr().err
    assert "unknown engine 'nope'; installed engines: hf" in err


def test_the_checkpoint_is_required(capsys):
    with pytest.raises(SystemExit):
        main([])
    assert "the checkpoint folder is required" in capsys.readouterr().err


def test_a_checkpoint_that_is_no_folder_is_named(tmp_path, capsys):
    assert main([str(tmp_path / "missing")]) == 2
    assert f"{tmp_path / 'missing'} is not a folder" in capsys.readouterr().err


def test_engine_arguments_read_json_values_else_text():
    assert engine_arguments(["max_batch_size=32", "attn=sdpa", "flag=true", "x="]) == {
        "max_batch_size": 32, "attn": "sdpa", "flag": True, "x": ""}
    with pytest.raises(SystemExit, match="expected KEY=VALUE"):
        engine_arguments(["max_batch_size"])


def _args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["ckpt", *argv])


def test_keys_come_from_the_named_variables(monkeypatch):
    monkeypatch.setenv("CHAT", "k1")
    monkeypatch.setenv("CTRL", "k2")
    keys = read_serve_keys(_args("--api-key-env", "CHAT", "--control-key-env", "CTRL"))
    assert (keys.api_key, keys.control_key) == ("k1", "k2")
    assert read_serve_keys(_args()).control_key is None
    monkeypatch.delenv("CTRL")
    with pytest.raises(SystemExit, match="--control-key-env=CTRL: that environment variable is not set"):
        read_serve_keys(_args("--control-key-env", "CTRL"))
    monkeypatch.setenv("CTRL", "k1")
    with pytest.raises(SystemExit, match="same key as --api-key-env"):
        read_serve_keys(_args("--api-key-env", "CHAT", "--control-key-env", "CTRL"))
