"""The Responses and Messages routes under hostile clients: the same keys, session isolation,
limits and trainer settings as chat completions, and errors in each API's own shape.

A route added to the gateway is a new door: each test below sends what a chat-completions test
of :mod:`test_control_hostile` or :mod:`test_limits_sizes` sends, through ``/v1/responses`` and
``/v1/messages``. Every server is real uvicorn on 127.0.0.1 in a thread; clients are httpx. A
200 where a refusal is expected means the route was mounted outside the guard's chat allow-list
(``agentloop_engines.serving.control.CHAT_PATHS``) or translates its body past a check the chat path makes.
"""

from __future__ import annotations

from typing import Any

import pytest

httpx = pytest.importorskip("httpx", reason='HTTP tests need httpx: pip install "agentloop-engines[server]"')
pytest.importorskip("fastapi", reason='HTTP tests need: pip install "agentloop-engines[server]"')

from agentloop_core.protocol import SamplingParams, TokenOutput  # noqa: E402
from agentloop_engines.base import AsyncServerBase  # noqa: E402
from agentloop_engines.serving.gateway import SESSION_HEADER, Gateway, GatewayThread, PromptLimits  # noqa: E402
from agentloop_engines.serving.server import ServerThread  # noqa: E402

KEY = "sk-chat-3f9a"
CONTROL = "ctl-7d21b0c4e5"
HANG_S = 20.0
"""How long a client waits before calling the server stuck (a safety net, not a measurement)."""

BODIES: dict[str, dict[str, Any]] = {
    "/v1/chat/completions": {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
    "/v1/responses": {"model": "m", "input": "hi", "max_output_tokens": 2},
    "/v1/messages": {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
    "/v1/messages/count_tokens": {"model": "m", "messages": [{"role": "user", "content": "hi"}]},
}
"""A body each chat route answers 200, keyed by path."""

ANTHROPIC = ("/v1/messages", "/v1/messages/count_tokens")


class Engine(AsyncServerBase):
    """Generates up to four tokens and records each call's sampling parameters."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = len(tokenizer)
        self.max_model_len = 4096
        self.eos_token_ids = (tokenizer.convert_tokens_to_ids("<|im_end|>"),)
        self.sampling: list[SamplingParams] = []

    async def _generate(self, request_id: str, prompt_ids: list[int], sp: SamplingParams) -> TokenOutput:
        self.sampling.append(sp)
        ids = [(prompt_ids[-1] + i) % 200 + 1 for i in range(1, min(sp.max_tokens, 4) + 1)]
        return TokenOutput(token_ids=ids, log_probs=[-0.5] * len(ids), stop_reason="length")


def check_shape(path: str, response: Any, status: int) -> dict[str, Any]:
    """The error of ``response`` after checking its status and its API's shape; returns
    ``{"type", "message"}``."""
    assert response.status_code == status, (path, response.status_code, response.text[:300])
    body = response.json()
    if any(path.endswith(p) for p in ANTHROPIC):
        assert body["type"] == "error", body
        assert set(body["error"]) >= {"type", "message"}, body
    else:
        assert set(body) == {"error"}, body
        assert set(body["error"]) >= {"type", "message", "code"}, body
    return body["error"]


@pytest.mark.parametrize("which", ["gateway", "engine"])
def test_every_route_takes_the_chat_key_and_no_other(tokenizer, which):
    """No key, a wrong key or the control key: 401 from the headers, in the route's own shape
    (Anthropic's ``authentication_error`` on /v1/messages). The chat key opens every route as a
    bearer token or as ``x-api-key`` (what the anthropic SDK sends)."""
    engine = Engine(tokenizer)
    gateway = Gateway(engine, tokenizer)
    thread = (GatewayThread(gateway, api_key=KEY, control_key=CONTROL) if which == "gateway"
              else ServerThread(engine, api_key=KEY, control_key=CONTROL, gateway=gateway))
    with thread as srv, httpx.Client(base_url=srv.url, timeout=HANG_S) as http:
        for path, body in BODIES.items():
            served = len(engine.sampling)
            for headers in ({}, {"x-api-key": "wrong"}, {"Authorization": "Bearer wrong"},
                            {"Authorization": f"Bearer {CONTROL}"}, {"x-api-key": CONTROL},
                            {"x-api-key": f"{KEY}x"}, {"Authorization": KEY}):
                error = check_shape(path, http.post(path, json=body, headers=headers), 401)
                if path in ANTHROPIC:
                    assert error["type"] == "authentication_error"
                assert KEY not in str(error)
                assert CONTROL not in str(error)
            assert len(engine.sampling) == served
            for headers in ({"Authorization": f"Bearer {KEY}"}, {"x-api-key": KEY}):
                r = http.post(path, json=body, headers=headers)
                assert r.status_code == 200, (path, headers, r.status_code, r.text[:300])


def test_a_session_id_alone_reaches_nothing_through_any_api(tokenizer):
    """The session key guards the new routes as it guards chat completions: another session's
    key, no key, or the session header without its key reach nothing, and nothing is generated."""
    engine = Engine(tokenizer)
    gateway = Gateway(engine, tokenizer)
    gateway.open_session("victim")
    gateway.open_session("agent")
    with GatewayThread(gateway, api_key=KEY) as gw, httpx.Client(base_url=gw.url, timeout=HANG_S,
                                                               headers={"x-api-key": KEY}) as http:
        agent_url = gw.session_url("agent")
        agent_key = agent_url.removeprefix(f"{gw.url}/sessions/agent/").removesuffix("/v1")
        for path, body in BODIES.items():
            route = path.removeprefix("/v1")
            for url, headers in ((f"/sessions/victim/v1{route}", {}),
                                 (f"/sessions/victim/{agent_key}/v1{route}", {}),
                                 (f"/sessions/victim/x/v1{route}", {}),
                                 (path, {SESSION_HEADER: "victim"}),
                                 (path, {SESSION_HEADER: "victim", "X-Agentloop-Session-Key": agent_key}),
                                 (f"/sessions/agent/{agent_key}/v1{route}", {SESSION_HEADER: "victim"})):
                r = http.post(url, json=body, headers=headers)
                assert r.status_code in (400, 404), (url, headers, r.status_code, r.text[:300])
                check_shape(url, r, r.status_code)
        assert engine.sampling == []
    assert gateway.close_session("victim") == []


def test_a_stored_response_is_not_reachable_from_another_session(tokenizer):
    """``previous_response_id`` names a response of the caller's own session only: the id of a
    response made in another session (learned from a log) is refused, and its text never
    reaches the attacker's prompt."""
    engine = Engine(tokenizer)
    gateway = Gateway(engine, tokenizer)
    gateway.open_session("victim")
    gateway.open_session("agent")
    with GatewayThread(gateway, api_key=KEY) as gw, httpx.Client(timeout=HANG_S,
                                                               headers={"Authorization": f"Bearer {KEY}"}) as http:
        secret = "the ground truth is 1234"
        r = http.post(f"{gw.session_url('victim')}/responses", json={"input": secret, "max_output_tokens": 2})
        assert r.status_code == 200, r.text
        stolen = r.json()["id"]
        for url in (f"{gw.session_url('agent')}/responses", f"{gw.base_url}/responses"):
            r = http.post(url, json={"input": "go on", "previous_response_id": stolen, "max_output_tokens": 2})
            error = check_shape(url, r, 400)
            assert "previous_response_id" in error["message"]
            assert secret not in r.text
        assert len(engine.sampling) == 1
    assert [c.endpoint for c in gateway.close_session("agent")] == []


def test_session_settings_apply_to_every_api(tokenizer):
    """A session's sampling overrides and response budget bind calls through the Responses and
    Messages APIs as they bind chat completions: the agent's own temperature and token budget
    are overridden."""
    engine = Engine(tokenizer)
    gateway = Gateway(engine, tokenizer)
    gateway.open_session("mine", sampling_overrides={"temperature": 0.25}, response_length=3)
    with GatewayThread(gateway, api_key=KEY) as gw, httpx.Client(timeout=HANG_S, headers={"x-api-key": KEY}) as http:
        base = gw.session_url("mine")
        r = http.post(f"{base}/responses", json={"input": "hi", "temperature": 1.9, "max_output_tokens": 400})
        assert r.status_code == 200, r.text
        r = http.post(f"{base.removesuffix('/v1')}/v1/messages",
                      json={"messages": [{"role": "user", "content": "hi"}], "temperature": 0.9, "max_tokens": 400})
        # The first call spent the segment's whole budget (3 tokens); the second continues
        # nothing (a new conversation) but is refused or capped, never given 400 tokens.
        assert r.status_code in (200, 400), r.text
    assert engine.sampling, "nothing reached the engine"
    assert all(sp.temperature == 0.25 and sp.max_tokens <= 3 for sp in engine.sampling), engine.sampling
    assert {c.endpoint for c in gateway.close_session("mine")} <= {"responses", "messages"}


@pytest.mark.parametrize("path", ["/v1/responses", "/v1/messages"])
def test_limits_bind_the_new_routes(tokenizer, path):
    """The body limit (413 before the body is read, in the route's shape) and the prompt limits
    (messages per request) refuse over-limit requests through each API before anything renders."""
    engine = Engine(tokenizer)
    gateway = Gateway(engine, tokenizer, prompt_limits=PromptLimits(max_messages=4))
    many = [{"role": "user" if i % 2 == 0 else "assistant", "content": "x"} for i in range(9)]
    body = ({"input": many, "max_output_tokens": 2} if path == "/v1/responses"
            else {"messages": many, "max_tokens": 2})
    with GatewayThread(gateway, api_key=KEY, max_request_bytes=4096) as gw, \
            httpx.Client(base_url=gw.url, timeout=HANG_S, headers={"x-api-key": KEY}) as http:
        error = check_shape(path, http.post(path, content=b"{" + b" " * 8000 + b"}",
                                            headers={"content-type": "application/json"}), 413)
        assert "max_request_bytes" in error["message"]
        r = http.post(path, json=body)
        assert r.status_code in (400, 413), r.text
        error = check_shape(path, r, r.status_code)
        assert "max_messages" in error["message"], error
        error = check_shape(path, http.post(path, content=b"not json", headers={"content-type": "application/json"}),
                            400)
    assert engine.sampling == []
