"""HTTP server: real uvicorn on 127.0.0.1 in a thread, driven with httpx."""

from __future__ import annotations

import asyncio

import pytest

httpx = pytest.importorskip("httpx", reason='HTTP tests need: pip install "agentloop-engines[server]"')
pytest.importorskip("fastapi", reason='HTTP tests need: pip install "agentloop-engines[server]"')
pytest.importorskip("uvicorn", reason='HTTP tests need: pip install "agentloop-engines[server]"')

from agentloop_core.protocol import SamplingParams, ServerCapabilities, TokenOutput  # noqa: E402
from agentloop_core.testing import ScriptedServer, load_tiny_tokenizer  # noqa: E402
from agentloop_engines.base import AsyncServerBase  # noqa: E402
from agentloop_engines.serving.server import ServerThread, create_app  # noqa: E402

KEY = "s3cret-key"


class CountingEngine(AsyncServerBase):
    """Generates prompt[-1]+1, +2, ... (mod vocab); a request id starting with 'hold' waits for abort."""

    def __init__(self) -> None:
        self.tokenizer = load_tiny_tokenizer()
        self.vocab_size = len(self.tokenizer)
        self.max_model_len = 512
        self.eos_token_ids = (self.tokenizer.convert_tokens_to_ids("<|im_end|>"),)
        self._aborts: dict[str, asyncio.Event] = {}

    async def _generate(self, request_id: str, prompt_ids: list[int], sp: SamplingParams) -> TokenOutput:
        if request_id.startswith("hold"):
            event = self._aborts.setdefault(request_id, asyncio.Event())
            await event.wait()
            return TokenOutput(token_ids=[], log_probs=[] if sp.logprobs else None, stop_reason="aborted")
        ids = [(prompt_ids[-1] + i) % 200 + 1 for i in range(1, sp.max_tokens + 1)]
        return TokenOutput(token_ids=ids, log_probs=[-0.25] * len(ids) if sp.logprobs else None,
                           stop_reason="length")

    async def abort(self, request_id: str) -> None:
        self._aborts.setdefault(request_id, asyncio.Event()).set()


@pytest.fixture(scope="module")
def engine():
    return CountingEngine()


@pytest.fixture(scope="module")
def server(engine):
    with ServerThread(engine, api_key=KEY, max_request_bytes=4096) as srv:
        yield srv


@pytest.fixture
def http(server):
    with httpx.Client(base_url=server.url, timeout=10) as c:
        yield c


AUTH = {"Authorization": f"Bearer {KEY}"}


def test_binds_loopback_by_default_and_health_needs_no_key(server, http):
    assert server.host == "127.0.0.1"
    assert server.port > 0
    r = http.get("/health")
    assert r.status_code == 200
    assert r.json()["capabilities"] == ServerCapabilities().as_dict()


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY},
                                     {"Authorization": f"Basic {KEY}"}])
def test_generate_requires_the_bearer_key(http, headers):
    r = http.post("/generate", json={"request_id": "a", "prompt_ids": [5]}, headers=headers)
    assert r.status_code == 401
    assert r.headers["www-authenticate"] == "Bearer"
    assert "Authorization: Bearer" in r.json()["error"]["message"]


def test_generate_returns_the_engines_tokens(http):
    r = http.post("/generate", headers=AUTH, json={
        "request_id": "a", "prompt_ids": [3, 4, 10], "sampling_params": {"max_tokens": 3}})
    assert r.status_code == 200, r.text
    body = r.json()
    instance = body.pop("instance")  # the server's lifetime id: clients see restarts by it
    assert body == {"token_ids": [12, 13, 14], "log_probs": [-0.25] * 3, "stop_reason": "length"}
    assert len(instance) == 32
    r = http.post("/generate", headers=AUTH, json={
        "request_id": "b", "prompt_ids": [7], "sampling_params": {"max_tokens": 2, "logprobs": False}})
    assert r.json()["log_probs"] is None
    assert r.json()["token_ids"] == [9, 10]
    assert r.json()["instance"] == instance


@pytest.mark.parametrize(("body", "message"), [
    ({"request_id": "a", "prompt_ids": [1], "sampling_params": {"max_token": 3}}, "did you mean 'max_tokens'"),
    ({"request_id": "a", "prompt_ids": [10**6]}, "outside the vocabulary"),
    ({"request_id": "a", "prompt_ids": []}, "prompt_ids is empty"),
    ({"request_id": "a", "prompt_ids": ["hello"]}, "prompt_ids.0"),
    ({"request_id": "a", "prompt_ids": [1], "temperature": 0}, "temperature: Extra inputs"),
    ({"prompt_ids": [1]}, "request_id: Field required"),
])
def test_bad_requests_are_400_with_the_reason(http, body, message):
    r = http.post("/generate", headers=AUTH, json=body)
    assert r.status_code == 400, r.text
    assert message in r.json()["error"]["message"]


def test_oversized_bodies_are_413(http):
    big = {"request_id": "a", "prompt_ids": [1] * 5000}
    r = http.post("/generate", headers=AUTH, json=big)
    assert r.status_code == 413
    assert "max_request_bytes" in r.json()["error"]["message"]

    def chunks():  # no Content-Length: the limit must count the streamed body
        yield b'{"request_id": "a", "prompt_ids": ['
        for _ in range(2000):
            yield b"1, "
        yield b"1]}"

    r = http.post("/generate", headers={**AUTH, "content-type": "application/json"}, content=chunks())
    assert r.status_code == 413


def test_chat_completions_are_the_gateways_and_carry_the_exact_tokens(http, engine):
    """Without ``gateway=`` the engine server serves ``/v1`` from a session-less gateway over
    its engine and tokenizer: text stops cut the reply (no 400 any more), sessions are refused."""
    r = http.post("/v1/chat/completions", headers=AUTH, json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
    assert r.status_code == 200, r.text
    body = r.json()
    choice = body["choices"][0]
    last = body["prompt_token_ids"][-1]
    assert choice["token_ids"] == [(last + i) % 200 + 1 for i in range(1, 5)]
    assert choice["message"]["content"] == engine.tokenizer.decode(choice["token_ids"], skip_special_tokens=True)
    stop = engine.tokenizer.decode(choice["token_ids"][2:3])
    r = http.post("/v1/chat/completions", headers=AUTH, json={"messages": [{"role": "user", "content": "hi"}],
                                                               "max_tokens": 4, "stop": [stop]})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["token_ids"] == choice["token_ids"][:3]
    r = http.post("/v1/chat/completions", headers={**AUTH, "X-Agentloop-Session": "s"},
                  json={"messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 400
    assert "records no sessions" in r.json()["error"]["message"]
    assert http.get("/sessions", headers=AUTH).status_code == 401  # a control route: not the chat key's
    assert http.post("/v1/chat/completions", json={"messages": []}).status_code == 401


def test_v1_on_an_engine_without_a_tokenizer_is_501():
    with ServerThread(ScriptedServer()) as srv, httpx.Client(base_url=srv.url) as c:
        r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 501
        assert "POST /generate" in r.json()["error"]["message"]
        assert c.get("/v1/models").status_code == 501
        # No api_key: no auth needed.
        assert c.post("/generate", json={"request_id": "x", "prompt_ids": [1]}).status_code == 200


async def test_abort_over_http_stops_an_in_flight_request(server):
    async with httpx.AsyncClient(base_url=server.url, headers=AUTH, timeout=10) as c:
        pending = asyncio.create_task(c.post("/generate", json={"request_id": "hold-1", "prompt_ids": [1]}))
        await asyncio.sleep(0.2)
        assert not pending.done()
        r = await c.post("/abort", json={"request_id": "hold-1"}, headers={"Authorization": f"Bearer {server.control_key}"})
        assert r.status_code == 200
        out = (await asyncio.wait_for(pending, 5)).json()
        assert out["stop_reason"] == "aborted"


def test_create_app_rejects_bad_settings(engine):
    with pytest.raises(ValueError, match="max_request_bytes"):
        create_app(engine, max_request_bytes=0)
    with pytest.raises(ValueError, match="empty string"):
        create_app(engine, api_key="")
    with pytest.raises(ValueError, match="has no tokenizer"):
        create_app(ScriptedServer(), tool_parser="hermes")


def test_limits_reject_bad_settings_by_name():
    from agentloop_engines.serving.common import ServerLimits
    from agentloop_engines.serving.gateway import PromptLimits

    with pytest.raises(ValueError, match="max_in_flight"):
        ServerLimits(max_in_flight=0)
    with pytest.raises(ValueError, match="body_timeout_s"):
        ServerLimits(body_timeout_s=-1)
    with pytest.raises(ValueError, match="must exceed max_in_flight"):
        ServerLimits(max_in_flight=100, max_connections=100)
    with pytest.raises(ValueError, match="max_prompt_tokens"):
        PromptLimits(max_prompt_tokens=0)
    with pytest.raises(ValueError, match=r"\['tools'\].*not template variables"):
        PromptLimits(template_variables=("enable_thinking", "tools"))


def test_default_keep_alive_outlasts_the_clients_idle_expiry():
    """The server keeps an idle connection longer than httpx (so the openai client and
    ``EngineHTTPClient``) keeps it in its pool, so the client always drops it first and never sends
    a request onto a connection the server is closing (a reset, not a retryable refusal); and a
    new connection's first byte gets no shorter than that."""
    from agentloop_engines.serving.common import ServerLimits

    limits, client = ServerLimits(), httpx.Limits()
    assert client.keepalive_expiry is not None
    assert limits.keep_alive_timeout_s >= 4 * client.keepalive_expiry, (limits.keep_alive_timeout_s, client)
    assert limits.first_byte_timeout_s >= limits.keep_alive_timeout_s
    assert limits.header_timeout_s < limits.first_byte_timeout_s
    with pytest.raises(ValueError, match="first_byte_timeout_s"):
        ServerLimits(first_byte_timeout_s=0)


def test_an_oversized_request_head_is_400(server, http):
    # Over max_header_bytes (64 KiB) and over one 256 KiB read, so h11 sees it incomplete.
    try:
        r = http.post("/generate", json={"request_id": "x", "prompt_ids": [1]},
                      headers={**AUTH, "X-Padding": "a" * 400_000})
        assert r.status_code == 400
    except (httpx.ReadError, httpx.WriteError):
        pass  # uvicorn answers 400 and closes while the head still arrives: the client may see the reset first
    assert http.get("/health").status_code == 200
