"""``forget_session`` over HTTP: ``POST /forget_session`` on the engine server, which
``EngineHTTPClient`` sends without waiting where the server lists the route, so a remote
HFServer's prefix cache drops a finished trajectory's last turn as an in-process one does."""

from __future__ import annotations

import asyncio
import logging

import pytest

httpx = pytest.importorskip("httpx", reason='HTTP tests need: pip install "agentloop-engines[server]"')
pytest.importorskip("fastapi", reason='HTTP tests need: pip install "agentloop-engines[server]"')
pytest.importorskip("uvicorn", reason='HTTP tests need: pip install "agentloop-engines[server]"')
pytest.importorskip("torch", reason='HFServer needs pip install "agentloop-engines[hf]"')

import agentloop_core.testing.loops  # noqa: E402,F401  registers test_chat
from agentloop_core.runtime import AgentLoopWorker  # noqa: E402
from agentloop_core.testing.loops import TEST_CHAT_AGENT  # noqa: E402
from agentloop_engines.adapters.hf import HFServer  # noqa: E402
from agentloop_engines.fleet.client import LLMServerClient  # noqa: E402
from agentloop_engines.fleet.http_client import EngineHTTPClient  # noqa: E402
from agentloop_engines.fleet.id_batches import GATHER_S  # noqa: E402
from agentloop_engines.serving.server import ServerThread  # noqa: E402

KEY = "chat-key-1"
CONTROL = "control-key-1"
PARAMS = {"max_tokens": 5, "temperature": 0, "ignore_eos": True, "logprobs": True}


async def test_the_client_tells_the_server_and_the_entry_goes(model_path):
    engine = HFServer(model_path, prefix_cache_tokens=4096)
    with ServerThread(engine, api_key=KEY, control_key=CONTROL) as thread:
        client = EngineHTTPClient(thread.url, api_key=KEY)  # the chat key alone: a chat route
        assert (await client.connect()).forget_session
        await client.generate("t", list(range(10, 40)), PARAMS)
        assert engine.prefix_cache is not None
        assert len(engine.prefix_cache) == 1
        sent: list[dict] = []
        request = client._request

        async def counted(method, path, **kwargs):
            if path == "/forget_session":
                sent.append(kwargs["json"])
            return await request(method, path, **kwargs)

        client._request = counted
        # Given in one go, the ids travel in one request; the unknown one is ignored there.
        client.forget_session("unknown")
        client.forget_session("t")
        await client.close()  # waits for the ids still to send
        assert sent == [{"request_ids": ["unknown", "t"]}]
        assert len(engine.prefix_cache) == 0
        assert engine.stats["prefix_cache_forgotten"] == 1

        async with httpx.AsyncClient(base_url=thread.url) as raw:
            body = {"request_ids": ["t"]}
            assert (await raw.post("/forget_session", json=body)).status_code == 401
            chat = {"Authorization": f"Bearer {KEY}"}
            answer = await raw.post("/forget_session", json=body, headers=chat)
            assert (answer.status_code, answer.json()) == (200, {"forgotten": 1})
            for bad in ({"request_ids": []}, {"request_ids": [""]}, {"request_ids": [3]}, {"request_id": "t"},
                        {"request_ids": ["t"] * 1025}, {**body, "x": 1}):
                assert (await raw.post("/forget_session", json=bad, headers=chat)).status_code == 400, bad
            assert (await raw.get("/health")).json()["optional_routes"] == ["/forget_session"]


async def test_ids_given_while_a_batch_is_out_go_in_the_next(model_path):
    engine = HFServer(model_path, prefix_cache_tokens=4096)
    with ServerThread(engine) as thread:
        client = EngineHTTPClient(thread.url)
        await client.connect()
        for k in range(3):
            await client.generate(f"t{k}", list(range(10 + k, 40)), PARAMS)
        sent: list[list[str]] = []
        request = client._request

        async def slow(method, path, **kwargs):
            sent.append(kwargs["json"]["request_ids"])
            await asyncio.sleep(0.05)
            return await request(method, path, **kwargs)

        client._request = slow
        client.forget_session("t0")
        await asyncio.sleep(GATHER_S + 0.02)  # the first batch is out
        client.forget_session("t1")
        client.forget_session("t2")
        await client.close()
    assert sent == [["t0"], ["t1", "t2"]]
    assert engine.prefix_cache is not None
    assert len(engine.prefix_cache) == 0


async def test_an_engine_that_keeps_nothing_is_sent_nothing_and_answers_501(model_path):
    engine = HFServer(model_path, enable_prefix_caching=False)
    with ServerThread(engine) as thread:
        client = EngineHTTPClient(thread.url)
        assert not (await client.connect()).forget_session
        client.forget_session("t")
        assert client._forgets.task is None  # nothing to send
        async with httpx.AsyncClient(base_url=thread.url) as raw:
            answer = await raw.post("/forget_session", json={"request_ids": ["t"]})
        assert answer.status_code == 501
        assert "capabilities.forget_session=False" in answer.json()["error"]["message"]
        await client.close()


async def test_a_hint_that_fails_is_logged_not_raised(model_path, caplog):
    engine = HFServer(model_path, prefix_cache_tokens=4096)
    with ServerThread(engine) as thread:
        client = EngineHTTPClient(thread.url, connect_timeout_s=2.0)
        await client.connect()
    # The server is gone: the hint fails on the event loop, and only a warning says so.
    with caplog.at_level(logging.WARNING, logger="agentloop_engines.fleet.http_client"):
        client.forget_session("gone")
        await client.close()
    assert any("forget_session failed for 1 request ids" in r.getMessage() for r in caplog.records)
    await client.close()


async def test_a_worker_batch_over_http_leaves_the_remote_cache_empty(model_path, tokenizer):
    """The real chain: worker -> routing client -> EngineHTTPClient -> the engine server ->
    HFServer, two-turn trajectories two at a time, the cache bounded to about three entries."""
    engine = HFServer(model_path, prefix_cache_tokens=150)
    with ServerThread(engine, api_key=KEY, control_key=CONTROL) as thread:
        remote = EngineHTTPClient(thread.url, api_key=KEY, control_key=CONTROL)
        await remote.connect()
        client = LLMServerClient([remote])
        worker = AgentLoopWorker(client, tokenizer, {
            "sampling_params": {"max_tokens": 4, "temperature": 1.0}, "max_concurrent_samples": 2,
            "sampling_seed": 0})
        rows = [{"agent_name": TEST_CHAT_AGENT, "raw_prompt": [{"role": "user", "content": f"question {i}"}],
                 "observation": "the tool says 42"} for i in range(8)]
        outputs = await worker.generate_sequences(rows)
        await remote.close()
    assert not any(o.failed for o in outputs)
    assert engine.prefix_cache is not None
    assert engine.stats["prefix_cache_hits"] == 8  # every second turn reused its first
    assert engine.stats["prefix_cache_forgotten"] == 8
    assert len(engine.prefix_cache) == 0
