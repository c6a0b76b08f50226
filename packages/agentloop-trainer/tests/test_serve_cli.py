"""``agentloop serve`` puts a checkpoint behind the OpenAI-compatible gateway: a stock ``openai``
client chats with it, lists it, and a session (opened with the control key) records the exact
tokens; without ``--control-key-env`` the control routes are off."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from agentloop_engines.testing.serve_process import start_server  # noqa: E402  (it needs httpx)

CONTROL = "c0ntrol-s3cret"
CONTROL_AUTH = {"Authorization": f"Bearer {CONTROL}"}


def _open(base: str, session_id: str) -> str:
    """Open a session with the control key; its base URL (which carries the session key)."""
    r = httpx.post(f"{base}/sessions/{session_id}", headers=CONTROL_AUTH)
    assert r.status_code == 200, r.text
    return base + r.json()["base_url"]


def _serve(*args: str) -> tuple[subprocess.Popen, str]:
    """Start `agentloop serve ARGS` and wait until it answers /health."""
    return start_server([sys.executable, "-m", "agentloop_trainer.cli.main", "serve", *args],
                        {**os.environ, "MY_KEY": "s3cret", "MY_CONTROL": CONTROL}, "agentloop serve")


def test_serve_a_checkpoint_to_the_openai_client(random_model_path):
    proc, base = _serve(str(random_model_path), "--api-key-env", "MY_KEY", "--control-key-env", "MY_CONTROL",
                        "--model-name", "tiny", "actor_rollout_ref.rollout.max_model_len=256")
    try:
        client = openai.OpenAI(base_url=_open(base, "s1"), api_key="s3cret")
        assert [m.id for m in client.models.list().data] == ["tiny"]
        reply = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}],
                                               max_tokens=5, temperature=0)
        assert reply.choices[0].finish_reason in ("stop", "length")
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{base}/v1", api_key="wrong").models.list()
        assert httpx.delete(f"{base}/sessions/s1", headers={"Authorization": "Bearer s3cret"}).status_code == 401
        recorded = httpx.delete(f"{base}/sessions/s1", headers=CONTROL_AUTH).json()
        assert recorded["num_calls"] == 1
        call = recorded["calls"][0]
        # The ids the client saw in the extension field are the ones recorded for training.
        assert call["token_ids"] == reply.choices[0].model_extra["token_ids"]
        assert 0 < len(call["token_ids"]) <= 5
        assert len(call["log_probs"]) == len(call["token_ids"])
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_serve_routes_over_running_engines(random_model_path):
    from agentloop_engines.adapters.hf import HFServer
    from agentloop_engines.serving.server import ServerThread

    engines = [HFServer(str(random_model_path), seed=0) for _ in range(2)]
    with ServerThread(engines[0]) as a, ServerThread(engines[1]) as b:
        proc, base = _serve(str(random_model_path), f"actor_rollout_ref.rollout.server_urls=[{a.url},{b.url}]",
                            "--control-key-env", "MY_CONTROL")
        try:
            for k in range(4):
                client = openai.OpenAI(base_url=_open(base, f"t{k}"), api_key="unused")
                for _ in range(2):
                    client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Hi"}],
                                                   max_tokens=3)
            served = [httpx.get(f"{base}/sessions/t{k}", headers=CONTROL_AUTH).json()["calls"] for k in range(4)]
            # Each session stayed on one replica, and the sessions were spread over both.
            replicas = [{call["extra"]["replica"] for call in calls} for calls in served]
            assert all(len(r) == 1 for r in replicas), replicas
            assert len(set().union(*replicas)) == 2, replicas
        finally:
            proc.terminate()
            proc.wait(timeout=30)


def test_serve_without_a_control_key_serves_no_control_route(random_model_path):
    proc, base = _serve(str(random_model_path), "actor_rollout_ref.rollout.max_model_len=256")
    try:
        for method, path in (("GET", "/sessions"), ("POST", "/sessions/s1"), ("POST", "/sleep"),
                             ("POST", "/update_weights")):
            r = httpx.request(method, f"{base}{path}", headers=CONTROL_AUTH)
            assert r.status_code == 403, (path, r.text)
            assert "--control-key-env" in r.json()["error"]["message"]
        assert httpx.post(f"{base}/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}],
                                                               "max_tokens": 2}).status_code == 200
    finally:
        proc.terminate()
        out = proc.communicate(timeout=30)[0]
    assert "control routes" in out
    assert CONTROL not in out


def test_serve_answers_the_responses_and_messages_apis(random_model_path):
    """`agentloop serve` serves the stock clients' Responses and Messages calls, streamed and not,
    with tool calls and their results in the history (several turns), in one recorded session:
    the ids each answer carries are the ones recorded for training."""
    anthropic = pytest.importorskip("anthropic")
    proc, base = _serve(str(random_model_path), "--api-key-env", "MY_KEY", "--control-key-env", "MY_CONTROL",
                        "actor_rollout_ref.rollout.max_model_len=1024")
    schema = {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}
    try:
        url = _open(base, "apis")
        oa = openai.OpenAI(base_url=url, api_key="s3cret", max_retries=0)
        tools = [{"type": "function", "name": "calculator", "description": "Evaluate.", "parameters": schema}]
        first = oa.responses.create(model="tiny", input="What is 3 + 4?", tools=tools, max_output_tokens=6)
        assert first.status in ("completed", "incomplete")
        history = [{"role": "user", "content": "What is 3 + 4?"},
                   {"type": "function_call", "call_id": "call_1", "name": "calculator",
                    "arguments": '{"expression": "3 + 4"}'},
                   {"type": "function_call_output", "call_id": "call_1", "output": "7"}]
        # The random model is cut at max_output_tokens: the stream ends with response.incomplete
        # (which responses.stream().get_final_response() refuses, as with OpenAI's own API).
        events = list(oa.responses.create(model="tiny", input=history, tools=tools, max_output_tokens=6, stream=True))
        assert events[0].type == "response.created"
        assert events[-1].type in ("response.completed", "response.incomplete")
        streamed = events[-1].response
        assert streamed.usage.output_tokens > 0
        an = anthropic.Anthropic(base_url=url.removesuffix("/v1"), api_key="s3cret", max_retries=0)
        atools = [{"name": "calculator", "description": "Evaluate.", "input_schema": schema}]
        message = an.messages.create(model="tiny", max_tokens=6, tools=atools,
                                     messages=[{"role": "user", "content": "What is 3 + 4?"}])
        assert message.stop_reason in ("end_turn", "max_tokens", "tool_use")
        turns = [{"role": "user", "content": "What is 3 + 4?"},
                 {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "calculator",
                                                    "input": {"expression": "3 + 4"}}]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "7"}]}]
        with an.messages.stream(model="tiny", max_tokens=6, tools=atools, messages=turns) as events:
            final = events.get_final_message()
        assert final.usage.output_tokens > 0
        recorded = httpx.delete(f"{base}/sessions/apis", headers=CONTROL_AUTH).json()["calls"]
        assert [c["endpoint"] for c in recorded] == ["responses", "responses", "messages", "messages"]
        assert recorded[0]["token_ids"] == first.model_extra["token_ids"]
        assert recorded[1]["token_ids"] == streamed.model_extra["token_ids"]
        assert recorded[2]["token_ids"] == message.model_extra["token_ids"]
        assert [len(c["token_ids"]) for c in recorded] == [first.usage.output_tokens, streamed.usage.output_tokens,
                                                           message.usage.output_tokens, final.usage.output_tokens]
        for c in recorded:
            assert len(c["log_probs"]) == len(c["token_ids"]) > 0
        # The same history sent as Responses items and as Messages blocks: the same prompt.
        assert recorded[1]["prompt_ids"] == recorded[3]["prompt_ids"]
    finally:
        proc.terminate()
        proc.wait(timeout=30)
