"""Control of the trainer's state under hostile clients: the control credential, sessions that
only their own trajectory can reach, weight updates that apply whole or not at all, and
parallel weight uploads.

Every server is real uvicorn on 127.0.0.1 in a thread; clients are httpx, the ``openai``
client or raw sockets. A held weight update waits on an event, never on a sleep; the timeouts
below only keep a broken server from hanging the suite. To debug a failure, run one test with
``-s --log-cli-level=DEBUG`` and read uvicorn's log.
"""

from __future__ import annotations

import asyncio
import socket
import threading
from typing import Any

import pytest
from fault_helpers import read_response

httpx = pytest.importorskip("httpx", reason='HTTP tests need httpx: pip install "agentloop-engines[server]"')
pytest.importorskip("fastapi", reason='HTTP tests need: pip install "agentloop-engines[server]"')
torch = pytest.importorskip("torch", reason='weight tests need torch: pip install "agentloop-engines[hf]"')

from agentloop_core.protocol import SamplingParams, ServerCapabilities, TokenOutput  # noqa: E402
from agentloop_core.testing import ScriptedServer  # noqa: E402
from agentloop_engines.base import AsyncServerBase  # noqa: E402
from agentloop_engines.fleet.http_client import EngineHTTPClient, serialize_weights  # noqa: E402
from agentloop_engines.serving.common import UvicornThread  # noqa: E402
from agentloop_engines.serving.gateway import SESSION_HEADER, Gateway, GatewayThread  # noqa: E402
from agentloop_engines.serving.server import ServerThread, create_app  # noqa: E402

KEY = "sk-chat-3f9a"
"""The chat key: what agents and chat users hold."""
CONTROL = "ctl-7d21b0c4e5"
"""The control key: what only the trainer holds."""
AUTH = {"Authorization": f"Bearer {KEY}"}
CONTROL_AUTH = {"Authorization": f"Bearer {CONTROL}"}
HANG_S = 20.0
"""How long a client waits before calling the server stuck (a safety net, not a measurement)."""
HI = [{"role": "user", "content": "hi"}]

CONTROL_ROUTES = [
    ("POST", "/update_weights", None),
    ("POST", "/sleep", None),
    ("POST", "/wake_up", None),
    ("POST", "/abort", {"request_id": "victim"}),
    ("GET", "/sessions", None),
    ("POST", "/sessions/victim", {"sampling_params": {"temperature": 2.0}}),
    ("GET", "/sessions/victim", None),
    ("DELETE", "/sessions/victim", None),
]
"""Every route that changes or reads the trainer's state, with a body that would work."""

NOT_CONTROL = [{}, AUTH, {"Authorization": "Bearer wrong"}, {"Authorization": f"Bearer {CONTROL}x"},
               {"Authorization": CONTROL}, {"Authorization": f"Basic {CONTROL}"}]
"""Credentials that must not open a control route: none, the chat key, near misses."""


class ControlledEngine(AsyncServerBase):
    """Generates four tokens and records every control call it gets (``events``); with
    :attr:`hold_updates` set, ``update_weights`` waits for :attr:`release`."""

    capabilities = ServerCapabilities(sleep=True, weight_update=True)

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = len(tokenizer)
        self.max_model_len = 4096
        self.eos_token_ids = (tokenizer.convert_tokens_to_ids("<|im_end|>"),)
        self.events: list[str] = []
        self.sampling: list[SamplingParams] = []
        self.hold_updates = False
        self.updating = threading.Event()
        self.release = threading.Event()

    async def _generate(self, request_id: str, prompt_ids: list[int], sp: SamplingParams) -> TokenOutput:
        self.sampling.append(sp)
        ids = [(prompt_ids[-1] + i) % 200 + 1 for i in range(1, min(sp.max_tokens, 4) + 1)]
        return TokenOutput(token_ids=ids, log_probs=[-0.5] * len(ids), stop_reason="length")

    async def abort(self, request_id: str) -> None:
        self.events.append(f"abort {request_id}")

    async def sleep(self) -> None:
        self.events.append("sleep")

    async def wake_up(self) -> None:
        self.events.append("wake_up")

    async def update_weights(self, named_tensors: Any) -> None:
        names = [name for name, _ in named_tensors]
        if self.hold_updates:
            self.updating.set()
            await asyncio.to_thread(self.release.wait, HANG_S * 2)
        self.events.append(f"update_weights {names}")


def request(http: Any, method: str, url: str, body: Any, headers: dict[str, str]) -> Any:
    if body is None and url.endswith("/update_weights"):
        return http.request(method, url, content=serialize_weights({"w": torch.zeros(2)}), headers=headers)
    return http.request(method, url, json=body, headers=headers)


# ---- the control credential ----------------------------------------------------------------------


def test_control_routes_refuse_no_key_and_the_chat_key(tokenizer):
    """The engine server as ``agentloop serve`` runs it (a gateway with sessions mounted): every
    control route refuses a request without the control key (401) and changes nothing; the chat
    key never opens one. Debug: a 200 here means the route is missing from the guard's chat
    allow-list logic (agentloop_engines.serving.control) or the route was added outside it."""
    engine = ControlledEngine(tokenizer)
    gateway = Gateway(engine, tokenizer)
    gateway.open_session("victim", sampling_overrides={"temperature": 0.5})
    with ServerThread(engine, api_key=KEY, control_key=CONTROL, gateway=gateway) as srv, \
            httpx.Client(base_url=srv.url, timeout=HANG_S) as http:
        for method, path, body in CONTROL_ROUTES:
            for headers in NOT_CONTROL:
                r = request(http, method, path, body, headers)
                assert r.status_code == 401, (method, path, headers, r.status_code, r.text[:300])
                error = r.json()["error"]
                assert "control key" in error["message"], error
                assert CONTROL not in r.text
                assert KEY not in r.text
        assert engine.events == []
        assert gateway.recorder.session_ids() == ["victim"]
        # The chat routes still take the chat key (and not the control key in its place).
        assert http.post("/generate", json={"request_id": "g", "prompt_ids": [3]}, headers=AUTH).status_code == 200
        assert http.post("/v1/chat/completions", json={"messages": HI}, headers=AUTH).status_code == 200
        assert http.post("/v1/chat/completions", json={"messages": HI}, headers=CONTROL_AUTH).status_code == 401
        # With the control key every control route works.
        for method, path, body in CONTROL_ROUTES:
            r = request(http, method, path, body, CONTROL_AUTH)
            assert r.status_code in (200, 409), (method, path, r.status_code, r.text[:300])
    assert engine.events == ["update_weights ['w']", "sleep", "wake_up", "abort victim"]


@pytest.mark.parametrize("which", ["engine", "gateway"])
def test_control_routes_are_off_without_a_control_key(tokenizer, which):
    """An app built without ``control_key`` (``agentloop serve`` without ``--control-key-env``)
    answers every control route 403 naming how to turn control on, whatever the client sends."""
    from agentloop_engines.serving.gateway.app import create_gateway_app

    engine = ControlledEngine(tokenizer)
    gateway = Gateway(engine, tokenizer)
    app = (create_app(engine, api_key=KEY, gateway=gateway) if which == "engine"
           else create_gateway_app(gateway, api_key=KEY))
    routes = CONTROL_ROUTES if which == "engine" else [r for r in CONTROL_ROUTES if r[1].startswith("/sessions")]
    with UvicornThread(app) as srv, httpx.Client(base_url=srv.url, timeout=HANG_S) as http:
        for method, path, body in routes:
            for headers in (AUTH, {}, CONTROL_AUTH):
                r = request(http, method, path, body, headers)
                assert r.status_code == 403, (method, path, headers, r.status_code, r.text[:300])
                assert "control_key" in r.json()["error"]["message"]
    assert engine.events == []


# ---- sessions reachable only by their trajectory --------------------------------------------------


def test_a_session_id_alone_reaches_nothing(tokenizer):
    """Knowing a session's id (from a row index, a log line) and holding the chat key and another
    session's URL is not enough to list, read, inject into, delete or reopen it. Debug: a 200 on
    an injection means the session routes check only the id; the URL must carry its session key."""
    engine = ControlledEngine(tokenizer)
    gateway = Gateway(engine, tokenizer)
    gateway.open_session("victim", sampling_overrides={"temperature": 0.5})
    gateway.open_session("agent", sampling_overrides={"temperature": 0.5})
    with GatewayThread(gateway, api_key=KEY) as gw, httpx.Client(base_url=gw.url, timeout=HANG_S,
                                                               headers=AUTH) as http:
        victim_url, agent_url = gw.session_url("victim"), gw.session_url("agent")
        assert victim_url != f"{gw.url}/sessions/victim/v1"  # the URL carries more than the id
        r = http.post(f"{victim_url}/chat/completions", json={"messages": HI, "max_tokens": 2})
        assert r.status_code == 200, r.text
        agent_key = agent_url.removeprefix(f"{gw.url}/sessions/agent/").removesuffix("/v1")
        chat = {"messages": [{"role": "user", "content": "injected"}], "max_tokens": 2}
        hostile = [
            ("GET", "/sessions", None, {}),
            ("GET", "/sessions/victim", None, {}),
            ("DELETE", "/sessions/victim", None, {}),
            ("POST", "/sessions/victim", {"sampling_params": {"temperature": 2.0}}, {}),
            ("POST", "/sessions/victim/v1/chat/completions", chat, {}),
            ("POST", "/sessions/victim/v1/completions", {"prompt": [3], "max_tokens": 2}, {}),
            ("POST", f"/sessions/victim/{agent_key}/v1/chat/completions", chat, {}),
            ("POST", "/sessions/victim/x/v1/chat/completions", chat, {}),
            ("POST", "/v1/chat/completions", chat, {SESSION_HEADER: "victim"}),
            ("POST", "/v1/chat/completions", chat, {SESSION_HEADER: "victim", "X-Agentloop-Session-Key": agent_key}),
            ("POST", f"/sessions/agent/{agent_key}/v1/chat/completions", chat, {SESSION_HEADER: "victim"}),
        ]
        for method, path, body, headers in hostile:
            r = http.request(method, path, json=body, headers=headers)
            assert r.status_code in (400, 401, 404), (method, path, headers, r.status_code, r.text[:300])
        assert len(engine.sampling) == 1  # nothing was generated for the attacker
    calls = gateway.close_session("victim")
    assert [c.request["messages"] for c in calls] == [HI]
    assert gateway.close_session("agent") == []


def test_an_agent_cannot_reopen_its_own_session(tokenizer):
    """An agent (its session URL and the chat key) cannot reopen or reconfigure its session to
    escape the trainer's sampling: POST /sessions/<id> needs the control key, and even the
    control key cannot change an open session's settings (409). Its calls keep the trainer's
    temperature and max_tokens whatever it asks for."""
    engine = ControlledEngine(tokenizer)
    gateway = Gateway(engine, tokenizer)
    gateway.open_session("mine", sampling_overrides={"temperature": 0.25, "max_tokens": 3}, response_length=3)
    with GatewayThread(gateway, api_key=KEY, control_key=CONTROL) as gw, \
            httpx.Client(base_url=gw.url, timeout=HANG_S, headers=AUTH) as http:
        base = gw.session_url("mine")
        key = base.removeprefix(f"{gw.url}/sessions/mine/").removesuffix("/v1")
        escape = {"sampling_params": {"temperature": 2.0, "max_tokens": 500}}
        for path in ("/sessions/mine", f"/sessions/mine/{key}", f"/sessions/mine/{key}/v1"):
            r = http.post(path, json=escape)
            assert r.status_code in (401, 404, 405), (path, r.status_code, r.text[:300])
        r = http.post("/sessions/mine", json=escape, headers=CONTROL_AUTH)
        assert r.status_code == 409, r.text
        assert "already open" in r.json()["error"]["message"]
        r = http.post(f"{base}/chat/completions", json={"messages": HI, "temperature": 1.9, "max_tokens": 400})
        assert r.status_code == 200, r.text
    (sp,) = engine.sampling
    assert (sp.temperature, sp.max_tokens) == (0.25, 3)


def test_http_agent_hands_its_agent_no_control(tokenizer):
    """The trainer's own loop: the base URL an ``http_agent`` agent gets opens its session and
    nothing else; what the agent tries with it (list sessions, reopen its session with other
    sampling, read or delete it) is refused, and its calls keep the trainer's temperature."""
    pytest.importorskip("openai", reason="the agent uses the openai client: pip install openai")
    from agentloop_engines.serving.http_agent import HTTPAgentLoop, close_gateways

    seen: dict[str, Any] = {}

    def agent(base_url: str, row: dict) -> float:
        import openai

        root, _, rest = base_url.partition("/sessions/")
        session_id = rest.split("/")[0]
        with httpx.Client(base_url=root, timeout=HANG_S) as http:
            seen["list"] = http.get("/sessions").status_code
            seen["reopen"] = http.post(f"/sessions/{session_id}",
                                       json={"sampling_params": {"temperature": 2.0}}).status_code
            seen["read"] = http.get(f"/sessions/{session_id}").status_code
            seen["delete"] = http.delete(f"/sessions/{session_id}").status_code
        client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0)
        reply = client.chat.completions.create(model="any", messages=row["raw_prompt"], temperature=1.9)
        return float(len(reply.choices[0].message.content or ""))

    engine = ScriptedServer(lambda request_id, prompt_ids, k: [5, 6], eos_token_id=2, append_eos=True)
    try:
        loop = HTTPAgentLoop(engine, tokenizer, {"agent": agent})
        (out,) = asyncio.run(loop.run({"temperature": 0.7, "max_tokens": 8}, raw_prompt=HI, index=0))
    finally:
        close_gateways()
    assert seen == {"list": 401, "reopen": 401, "read": 401, "delete": 401}, seen
    assert [c.sampling_params.temperature for c in engine.calls] == [0.7]
    assert out.metrics["http_calls"] == 1


# ---- weight updates apply whole or not at all -----------------------------------------------------


@pytest.fixture(scope="module")
def tiny_model_path() -> Any:
    from agentloop_engines.testing.tiny_model import build_tiny_model

    return build_tiny_model()


def _bad_updates(new: dict[str, Any]) -> list[tuple[str, str, list[tuple[str, Any]]]]:
    """``(case, the tensor the error must name, update)``: every tensor new, one of them bad,
    placed last so a loader that copies as it goes has changed everything else first."""
    names = list(new)
    last = names[-1]
    good = [(n, new[n]) for n in names[:-1]]
    return [
        ("unknown name", "model.layers.0.mlp.gate_prj.weight",
         [*good, (last, new[last]), ("model.layers.0.mlp.gate_prj.weight", new[names[0]])]),
        ("wrong shape", last, [*good, (last, torch.zeros(3, 5))]),
        ("transposed", "model.layers.0.mlp.down_proj.weight",
         [(n, v) for n, v in good if n != "model.layers.0.mlp.down_proj.weight"]
         + [("model.layers.0.mlp.down_proj.weight", new["model.layers.0.mlp.down_proj.weight"].T.contiguous())]),
        ("integer tensor", last, [*good, (last, torch.ones(new[last].shape, dtype=torch.int64))]),
    ]


def _assert_unchanged(model: Any, old: dict[str, Any], case: str) -> None:
    state = model.state_dict()
    changed = [n for n, v in old.items() if not torch.equal(state[n], v)]
    assert not changed, f"{case}: a refused update changed {len(changed)} tensors, e.g. {changed[:3]}"


def test_a_bad_weight_update_changes_nothing_in_hf(tiny_model_path):
    """HFServer checks every name, shape and dtype before it copies anything: an update with one
    bad tensor (last, so a copy-as-you-go loader would have changed all the others) leaves every
    weight as it was and its error names the tensor. Debug: compare the engine's state_dict with
    the old one; a changed tensor means the check ran inside the copy loop."""
    from agentloop_engines.adapters.hf import HFServer
    from agentloop_engines.testing import perturbed_weights

    old, new = perturbed_weights(tiny_model_path)
    engine = HFServer(str(tiny_model_path))

    async def run() -> None:
        for case, culprit, update in _bad_updates(new):
            with pytest.raises(ValueError, match="nothing was loaded") as info:
                await engine.update_weights(update)
            assert culprit in str(info.value), (case, str(info.value))
            _assert_unchanged(engine.model, old, case)
        await engine.update_weights(new)  # a good update still applies whole
        state = engine.model.state_dict()
        assert all(torch.equal(state[n], v) for n, v in new.items())
        await engine.close()

    asyncio.run(run())


def test_a_bad_weight_update_over_http_changes_nothing(tiny_model_path):
    """The same through ``POST /update_weights``: 400 naming the tensor, every weight unchanged."""
    from agentloop_engines.adapters.hf import HFServer
    from agentloop_engines.testing import perturbed_weights

    old, new = perturbed_weights(tiny_model_path)
    engine = HFServer(str(tiny_model_path))

    async def run(url: str) -> None:
        remote = EngineHTTPClient(url, api_key=KEY, control_key=CONTROL)
        for case, culprit, update in _bad_updates(new)[:2]:
            with pytest.raises(ValueError, match=culprit):
                await remote.update_weights(update)
            _assert_unchanged(engine.model, old, case)
        await remote.close()

    with ServerThread(engine, api_key=KEY, control_key=CONTROL) as srv:
        asyncio.run(run(srv.url))
    asyncio.run(engine.close())


def test_a_bad_weight_update_changes_nothing_in_sglang(tmp_path, monkeypatch):
    """SGLangServer checks names, shapes and dtypes against the checkpoint's safetensors headers
    before anything reaches SGLang (whose loader would skip unknown names and copy the rest)."""
    from safetensors.torch import save_file

    from agentloop_engines.adapters.sglang.server import SGLangServer
    from agentloop_engines.testing.sglang_standin import StandInSGLangEngine

    save_file({"model.embed_tokens.weight": torch.zeros(300, 8), "model.norm.weight": torch.ones(8),
               "step": torch.tensor(1)}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text('{"tie_word_embeddings": true, "vocab_size": 300, "eos_token_id": 2, '
                                          '"max_position_embeddings": 64, "dtype": "float32"}')
    engine = StandInSGLangEngine(str(tmp_path))
    server = SGLangServer(engine, eos_token_ids=[2])
    cases = [
        ("model.norm.weight", [("model.embed_tokens.weight", torch.ones(300, 8)), ("model.norm.weight", torch.ones(9))]),
        ("lm_head.weight", [("model.norm.weight", torch.ones(8)), ("lm_head.weight", torch.ones(8, 300))]),
        ("model.norm.weight", [("step", torch.tensor(2)), ("model.norm.weight", torch.ones(8, dtype=torch.int32))]),
        ("model.norm.weigth", [("step", torch.tensor(2)), ("model.norm.weigth", torch.ones(8))]),
    ]

    async def run() -> None:
        for culprit, update in cases:
            with pytest.raises(ValueError, match="nothing was loaded") as info:
                await server.update_weights(update)
            assert culprit in str(info.value), str(info.value)
        assert engine.weight_updates == []
        await server.update_weights([("model.norm.weight", torch.ones(8)), ("lm_head.weight", torch.ones(300, 8))])
        assert len(engine.weight_updates) == 1
        await server.close()

    asyncio.run(run())


# ---- parallel uploads --------------------------------------------------------------------------


def test_a_second_weight_upload_is_refused_at_once(tokenizer):
    """While one upload is being applied, another gets 409 from its headers alone: its body (here
    a declared 8 GiB never sent) is not read, so parallel uploads cannot pin memory together.
    Debug: a socket timeout means the guard waited for the second body (the one-at-a-time check
    must come before the body is read)."""
    engine = ControlledEngine(tokenizer)
    engine.hold_updates = True
    with ServerThread(engine, api_key=KEY, control_key=CONTROL) as srv:
        first: dict[str, Any] = {}

        def upload() -> None:
            first["r"] = httpx.post(f"{srv.url}/update_weights", headers=CONTROL_AUTH, timeout=HANG_S * 2,
                                    content=serialize_weights({"w": torch.zeros(4)}))

        worker = threading.Thread(target=upload)
        worker.start()
        try:
            assert engine.updating.wait(HANG_S), "the first upload never reached the engine"
            host, port = srv.url.removeprefix("http://").split(":")
            with socket.create_connection((host, int(port)), timeout=HANG_S) as sock:
                sock.sendall(b"POST /update_weights HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer " + CONTROL.encode()
                             + b"\r\nContent-Type: application/octet-stream\r\nContent-Length: 8589934592\r\n\r\n")
                head = read_response(sock)
            assert head.startswith(b"HTTP/1.1 409"), head[:300]
            assert b"one at a time" in head or b"in progress" in head, head[:600]
            r = httpx.post(f"{srv.url}/update_weights", headers=CONTROL_AUTH, timeout=HANG_S,
                           content=serialize_weights({"w": torch.zeros(4)}))
            assert r.status_code == 409, r.text
        finally:
            engine.release.set()
            worker.join(HANG_S)
        assert first["r"].status_code == 200, first["r"].text
        engine.hold_updates = False
        r = httpx.post(f"{srv.url}/update_weights", headers=CONTROL_AUTH, timeout=HANG_S,
                       content=serialize_weights({"w": torch.zeros(4)}))
        assert r.status_code == 200, r.text  # the slot is free again
    assert engine.events == ["update_weights ['w']", "update_weights ['w']"]
