"""Slow and vanished clients (issue #31, class 7).

* A client that sends a request and never reads the answer used to keep its in-flight slot for
  good (a streamed answer waits to send its next chunk) and its connection for good (an answer
  sent whole sits in the server's send buffer): enough of them lock everyone out. Now a
  connection whose answer has not been read for ``ServerLimits.write_timeout_s`` is aborted.
* A client that disconnects mid-generation used to leave the generation running to the end.
  Now the request's handler is cancelled, which stops the engine's row (HFServer decodes no
  further token for it) and frees the slot.

The clients here are raw sockets with a small receive buffer; the answers are big (megabytes),
so they cannot fit in the kernel's buffers and the server really has to wait on the client.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest

httpx = pytest.importorskip("httpx", reason='HTTP tests need httpx: pip install "agentloop-engines[server]"')
pytest.importorskip("fastapi", reason='HTTP tests need: pip install "agentloop-engines[server]"')

from agentloop_core.testing import ScriptedServer  # noqa: E402
from agentloop_engines.serving.common import ServerLimits, UvicornThread  # noqa: E402
from agentloop_engines.serving.gateway import Gateway  # noqa: E402
from agentloop_engines.serving.gateway.app import create_gateway_app  # noqa: E402
from agentloop_engines.serving.server import create_app  # noqa: E402

BIG = 400_000
"""Tokens in each scripted answer: megabytes of JSON or of streamed text."""
WRITE_TIMEOUT_S = 1.0
BOUND_S = 20.0
"""How long the test waits for the server to recover (far past the write deadline)."""


def big_server() -> ScriptedServer:
    return ScriptedServer(lambda rid, prompt, k: [(i * 7919) % 5000 + 100 for i in range(BIG)],
                          max_model_len=BIG + 1000)


def raw_request(port: int, path: str, body: dict) -> socket.socket:
    """Send ``body`` to ``path`` from a socket that then reads nothing (a tiny receive buffer)."""
    data = json.dumps(body).encode()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", port))
    sock.sendall(f"POST {path} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                 f"content-length: {len(data)}\r\n\r\n".encode() + data)
    return sock


def wait_for(condition: Callable[[], bool], bound_s: float = BOUND_S) -> bool:
    deadline = time.monotonic() + bound_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return condition()


@contextmanager
def serving(app, limits: ServerLimits) -> Iterator[UvicornThread]:
    with UvicornThread(app, limits=limits) as thread:
        yield thread


CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def test_clients_that_never_read_a_stream_lose_their_in_flight_slots(tokenizer):
    limits = ServerLimits(max_in_flight=3, write_timeout_s=WRITE_TIMEOUT_S)
    app = create_gateway_app(Gateway(big_server(), tokenizer), limits=limits)
    with serving(app, limits) as thread:
        stalled = [raw_request(thread.port, "/v1/chat/completions", {**CHAT, "max_tokens": BIG, "stream": True})
                   for _ in range(6)]
        try:
            assert wait_for(lambda: app.in_flight == 3, 10), "the stalled streams never took the slots"

            def served() -> bool:
                r = httpx.post(thread.url + "/v1/chat/completions", json={**CHAT, "max_tokens": 2}, timeout=10)
                return r.status_code == 200

            assert wait_for(served), (f"still locked out {BOUND_S}s after the write deadline: {app.in_flight} "
                                      "slots held by clients that read nothing")
            assert wait_for(lambda: app.in_flight == 0)
        finally:
            for sock in stalled:
                sock.close()


def test_clients_that_never_read_a_big_answer_lose_their_connections():
    # uvicorn answers every request 503 (/health too) past max_connections: held connections
    # lock everyone out even when no request is in flight (each answer was handed over whole).
    limits = ServerLimits(max_in_flight=2, max_connections=3, write_timeout_s=WRITE_TIMEOUT_S)
    app = create_app(big_server(), limits=limits)
    with serving(app, limits) as thread:
        stalled = []
        try:
            for i in range(2):
                stalled.append(raw_request(thread.port, "/generate", {
                    "request_id": f"r{i}", "prompt_ids": [1, 2, 3],
                    "sampling_params": {"max_tokens": BIG, "logprobs": True}}))
                stalled[-1].settimeout(30)
                assert stalled[-1].recv(12, socket.MSG_PEEK) == b"HTTP/1.1 200"  # answered, not read

            def healthy() -> bool:
                try:
                    return httpx.get(thread.url + "/health", timeout=5).status_code == 200
                except httpx.HTTPError:
                    return False

            assert wait_for(healthy), f"/health refused {BOUND_S}s after the write deadline: connections held"
            r = httpx.post(thread.url + "/generate", json={"request_id": "ok", "prompt_ids": [1],
                                                            "sampling_params": {"max_tokens": 3}}, timeout=10)
            assert r.status_code == 200
            assert len(r.json()["token_ids"]) == 3
        finally:
            for sock in stalled:
                sock.close()


def test_write_timeout_is_checked():
    with pytest.raises(ValueError, match="write_timeout_s"):
        ServerLimits(write_timeout_s=0)


# ---- clients that disconnect mid-generation -------------------------------------------------

torch = pytest.importorskip("torch", reason='HFServer needs pip install "agentloop-engines[hf]"')
pytest.importorskip("transformers", reason='HFServer needs pip install "agentloop-engines[hf]"')

from agentloop_engines.adapters.hf import HFServer  # noqa: E402
from agentloop_engines.testing.tiny_model import build_tiny_model  # noqa: E402

LONG = 1900
"""Tokens asked for: seconds of decoding on the tiny model, so a disconnect lands mid-way."""


@pytest.fixture(scope="module")
def engine():
    return HFServer(build_tiny_model(), max_model_len=2048)


@pytest.mark.parametrize(("path", "body"), [
    ("/generate", {"request_id": "gone", "prompt_ids": [1, 2, 3],
                   "sampling_params": {"max_tokens": LONG, "ignore_eos": True}}),
    ("/v1/chat/completions", {**CHAT, "max_tokens": LONG, "ignore_eos": True}),
])
def test_a_client_that_disconnects_mid_generation_stops_it(engine, path, body):
    app = create_app(engine)
    with serving(app, ServerLimits()) as thread:
        before = engine.stats["generated_tokens"]
        sock = raw_request(thread.port, path, body)
        assert wait_for(lambda: engine.stats["generated_tokens"] > before + 20, 30), "generation never started"
        sock.close()
        assert wait_for(lambda: app.in_flight == 0, 10), "the vanished client's request still holds its slot"
        time.sleep(0.5)  # the engine would have decoded hundreds more tokens by now
        generated = engine.stats["generated_tokens"] - before
        assert generated < LONG, f"the engine decoded all {generated} tokens for a client that had gone"
        assert not engine._by_id, "the engine still tracks the vanished request"
        # The engine serves the next request as usual.
        r = httpx.post(thread.url + "/generate", json={"request_id": "next", "prompt_ids": [1],
                                                        "sampling_params": {"max_tokens": 4, "ignore_eos": True}},
                       timeout=30)
        assert r.status_code == 200
        assert len(r.json()["token_ids"]) == 4


async def test_a_disconnect_on_the_http_agent_gateway_stops_the_generation_on_the_rollout_loop():
    """The gateway ``http_agent`` runs serves on its own thread and hands generation to the
    engine on the rollout's event loop: the cancellation crosses the two loops."""
    import asyncio

    from agentloop_engines.serving.gateway import GatewayThread

    engine = HFServer(build_tiny_model(), max_model_len=2048)
    gateway = Gateway(engine, engine.tokenizer, server_loop=asyncio.get_running_loop())
    try:
        with GatewayThread(gateway) as thread:
            gateway.open_session("s1")
            sock = raw_request(thread.port, "/sessions/s1/v1/chat/completions",
                               {**CHAT, "max_tokens": LONG, "ignore_eos": True})
            for _ in range(600):
                if engine.stats["generated_tokens"] > 20:
                    break
                await asyncio.sleep(0.05)
            sock.close()
            for _ in range(200):
                if not engine._by_id:
                    break
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.5)
            assert engine.stats["generated_tokens"] < LONG, "the engine decoded every token for a client that had gone"
            assert not engine._by_id
            assert gateway.recorder.get("s1") == [], "a cancelled call was recorded"
    finally:
        await engine.close()
