"""The HTTP server under hostile clients: loopback bind, bearer auth, size limit, and a burst
of concurrent malformed requests it must survive."""

from __future__ import annotations

import asyncio
import inspect
import socket

import pytest

httpx = pytest.importorskip("httpx", reason='HTTP tests need httpx: pip install "agentloop-engines[server]"')
pytest.importorskip("fastapi", reason='HTTP tests need: pip install "agentloop-engines[server]"')

from agentloop_core.testing import ScriptedServer  # noqa: E402
from agentloop_engines.serving.server import ServerThread, serve  # noqa: E402

KEY = "sk-http-fault-5f3e2d1c"
AUTH = {"Authorization": f"Bearer {KEY}"}
GOOD = {"request_id": "r1", "prompt_ids": [1, 2, 3], "sampling_params": {"max_tokens": 4}}


@pytest.fixture(scope="module")
def server():
    with ServerThread(ScriptedServer(), api_key=KEY, max_request_bytes=64 * 1024) as st:
        yield st


def test_binds_loopback_by_default(server):
    assert inspect.signature(serve).parameters["host"].default == "127.0.0.1"
    assert inspect.signature(ServerThread).parameters["host"].default == "127.0.0.1"
    assert server.host == "127.0.0.1"
    # Not reachable on another interface address of this host.
    other = _non_loopback_address()
    if other is None:
        pytest.skip("this host has no non-loopback IPv4 address to probe")
    with socket.socket() as s:
        s.settimeout(1)
        assert s.connect_ex((other, server.port)) != 0


def _non_loopback_address() -> str | None:
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("192.0.2.1", 9))  # no packet is sent for UDP connect
            addr = s.getsockname()[0]
    except OSError:
        return None
    return None if addr.startswith("127.") else addr


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY},
                                     {"Authorization": f"Basic {KEY}"}, {"Authorization": f"Bearer {KEY}x"}])
def test_requests_without_the_right_bearer_token_are_401(server, headers):
    for path, body in (("/generate", GOOD), ("/abort", {"request_id": "r1"}), ("/v1/chat/completions", {})):
        r = httpx.post(server.url + path, json=body, headers=headers, timeout=10)
        assert r.status_code == 401, (path, r.text)
        assert KEY not in r.text


def test_oversized_bodies_are_413_with_and_without_content_length(server):
    big = {"request_id": "r", "prompt_ids": [1] * 40000}
    r = httpx.post(server.url + "/generate", json=big, headers=AUTH, timeout=10)
    assert r.status_code == 413
    def chunks():
        for _ in range(100):
            yield b"0" * 4096
    r = httpx.post(server.url + "/generate", content=chunks(), headers=AUTH, timeout=10)
    assert r.status_code == 413


async def test_survives_a_burst_of_concurrent_malformed_requests(server):
    bad = [
        dict(content=b"{not json"),
        dict(content=b"\xff\xfe\x00garbage"),
        dict(json={"request_id": "", "prompt_ids": [1]}),
        dict(json={"request_id": "x", "prompt_ids": "abc"}),
        dict(json={"request_id": "x", "prompt_ids": [1], "sampling_params": {"max_tokens": -5}}),
        dict(json={"request_id": "x", "prompt_ids": [], "sampling_params": {}}),
        dict(json={"request_id": "x", "prompt_ids": [1], "extra": 1}),
        dict(json=[1, 2, 3]),
        dict(content=b"[" * 20000),
        dict(json={"request_id": "x", "prompt_ids": [1] * 40000}),
    ]
    async with httpx.AsyncClient(base_url=server.url, timeout=30,
                                 limits=httpx.Limits(max_connections=100)) as client:
        async def send(i: int):
            kw = bad[i % len(bad)]
            headers = dict(AUTH) if i % 7 else {}
            if "content" in kw:
                headers["content-type"] = "application/json"
            return await client.post("/generate", headers=headers, **kw)

        responses = await asyncio.gather(*(send(i) for i in range(300)))
        statuses = {r.status_code for r in responses}
        assert statuses <= {400, 401, 413, 422}, statuses
        assert {400, 401, 413} <= statuses, statuses
        odd = [(r.status_code, r.text[:200]) for r in responses if "error" not in r.json()]
        assert not odd, odd
        # Raw garbage and half-sent requests on bare sockets.
        for payload in (b"GARBAGE\r\n\r\n", b"POST /generate HTTP/1.1\r\nContent-Length: 100\r\n\r\n{"):
            reader, writer = await asyncio.open_connection(server.host, server.port)
            writer.write(payload)
            await writer.drain()
            writer.close()
        # Still healthy and still serving correct requests.
        assert (await client.get("/health")).status_code == 200
        r = await client.post("/generate", json=GOOD, headers=AUTH)
        assert r.status_code == 200
        assert len(r.json()["token_ids"]) == 4
