"""Streaming on the routed and remote paths: a streamed ``POST /generate`` (ndjson), read by
``EngineHTTPClient.generate_stream`` and routed by ``LLMServerClient.generate_stream``.

Real HFServer engines on the tiny model behind real uvicorn servers on 127.0.0.1, and the real
``openai`` client against a gateway over an ``LLMServerClient`` of two of them. What must hold:
the tokens arrive a few at a time, not as one block at the end, and join into exactly the
non-streamed greedy ids; a client that goes away stops the decode on the replica; a replica
that is down before the first delta is failed over; after the first delta nothing is retried;
the api key is required. The last tests use in-process scripted streams for the failure cases
that a real engine does not produce on demand (an error or a stall mid-stream).
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest

httpx = pytest.importorskip("httpx", reason='HTTP tests need: pip install "agentloop-engines[server]"')
openai = pytest.importorskip("openai", reason='gateway tests need the openai client: pip install "agentloop-engines[test]"')
pytest.importorskip("fastapi", reason='HTTP tests need: pip install "agentloop-engines[server]"')
pytest.importorskip("uvicorn", reason='HTTP tests need: pip install "agentloop-engines[server]"')
pytest.importorskip("torch", reason='HFServer needs pip install "agentloop-engines[hf]"')
pytest.importorskip("transformers", reason='HFServer needs pip install "agentloop-engines[hf]"')

from agentloop_core.protocol import SamplingParams, TokenOutput  # noqa: E402
from agentloop_engines import EngineHTTPClient  # noqa: E402
from agentloop_engines.adapters.hf import HFServer  # noqa: E402
from agentloop_engines.base import AsyncServerBase  # noqa: E402
from agentloop_engines.fleet.client import LLMServerClient, RequestTimeoutError  # noqa: E402
from agentloop_engines.fleet.http_client import EngineHTTPError, ReplicaBusyError  # noqa: E402
from agentloop_engines.serving.common import ServerLimits  # noqa: E402
from agentloop_engines.serving.gateway import Gateway, GatewayThread  # noqa: E402
from agentloop_engines.serving.server import ServerThread  # noqa: E402
from agentloop_engines.streaming import TokenDelta  # noqa: E402

KEY = "s3cret-key"
GREEDY = {"max_tokens": 24, "temperature": 0.0, "ignore_eos": True}
QUESTION = [{"role": "user", "content": "How many apples?"}]


@pytest.fixture
def replicas(model_path):
    """Two HFServer engines behind uvicorn threads with ``api_key=KEY``: [(engine, thread)]."""
    with contextlib.ExitStack() as stack:
        made = []
        for _ in range(2):
            engine = HFServer(model_path, max_model_len=2048)
            stack.callback(asyncio.run, engine.close())
            made.append((engine, stack.enter_context(ServerThread(engine, api_key=KEY))))
        yield made


async def _collect(stream, into: list[list[int]]) -> None:
    async for delta in stream:
        into.append(delta.token_ids)


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=120)


async def test_remote_and_routed_streams_join_into_the_greedy_ids(replicas):
    """EngineHTTPClient and LLMServerClient stream one or a few tokens per delta over HTTP; the
    deltas join into exactly the non-streamed ids and log-probs, and the routed output names
    its replica and engine instance."""
    remotes = [EngineHTTPClient(t.url, api_key=KEY) for _, t in replicas]
    try:
        prompt = [100, 200, 300, 400]
        params = {**GREEDY, "logprobs": True}
        whole = await remotes[0].generate("whole", prompt, params)
        deltas = [d async for d in remotes[1].generate_stream("streamed", prompt, params)]
        assert [t for d in deltas for t in d.token_ids] == whole.token_ids == deltas[-1].output.token_ids
        assert [lp for d in deltas for lp in d.log_probs] == pytest.approx(whole.log_probs, abs=1e-5)
        assert deltas[-1].output.stop_reason == "length"
        assert deltas[-1].output.extra["engine_instance"] == remotes[1].engine_instance
        # Structural, not a clock threshold: one delta at the end would be len(deltas) == 1.
        assert len(deltas) >= len(whole.token_ids) // 4, [len(d.token_ids) for d in deltas]

        client = LLMServerClient(remotes)
        routed = [d async for d in client.generate_stream("routed", prompt, params)]
        assert [t for d in routed for t in d.token_ids] == whole.token_ids
        assert len(routed) >= len(whole.token_ids) // 4
        assert routed[-1].output.extra["replica"] in (0, 1)
        assert client.in_flight == [0, 0]
        assert client.stats["completed"] == 1
    finally:
        for r in remotes:
            await r.close()


def test_openai_stream_through_a_gateway_over_two_remote_replicas(replicas):
    """The real openai client against a gateway over an LLMServerClient of two remote
    replicas: the chat arrives in many chunks and assembles into the non-streamed answer."""
    client = LLMServerClient([EngineHTTPClient(t.url, api_key=KEY) for _, t in replicas])
    tokenizer = replicas[0][0].tokenizer
    with GatewayThread(Gateway(client, tokenizer)) as t:
        c = _client(t.base_url)
        args = {"model": "tiny", "messages": QUESTION, "extra_body": {"ignore_eos": True}, "max_tokens": 32,
                "temperature": 0.0}
        whole = c.chat.completions.create(**args)
        chunks = list(c.chat.completions.create(**args, stream=True))
    content = [ch.choices[0].delta.content for ch in chunks if ch.choices and ch.choices[0].delta.content]
    assert "".join(content) == whole.choices[0].message.content
    last = [ch for ch in chunks if ch.choices][-1]
    assert last.choices[0].model_extra["token_ids"] == whole.choices[0].token_ids
    assert len(whole.choices[0].token_ids) == 32
    assert len(content) >= 32 // 4, f"{len(content)} content chunks for 32 tokens"


def test_an_openai_client_that_disconnects_stops_the_decode_on_the_replica(replicas):
    """Closing the openai stream after a few chunks: the gateway closes the routed stream, the
    EngineHTTPClient its connection, the engine server cancels the request: far fewer tokens are
    decoded than the 1,500 asked for, and the client's in-flight slot is free again."""
    engines = [e for e, _ in replicas]
    client = LLMServerClient([EngineHTTPClient(t.url, api_key=KEY) for _, t in replicas])
    asked = 1500
    with GatewayThread(Gateway(client, engines[0].tokenizer)) as t:
        before = sum(e.stats["generated_tokens"] for e in engines)
        stream = _client(t.base_url).chat.completions.create(
            model="tiny", messages=QUESTION, max_tokens=asked, temperature=0.0, stream=True,
            extra_body={"ignore_eos": True})
        chunks = iter(stream)
        seen = [next(chunks) for _ in range(4)]
        stream.close()
        deadline = time.monotonic() + 60
        while (any(e._by_id for e in engines) or any(client.in_flight)) and time.monotonic() < deadline:
            time.sleep(0.02)
        after = sum(e.stats["generated_tokens"] for e in engines) - before
    assert len(seen) == 4
    assert not any(e._by_id for e in engines), "the request was still decoding a minute after its client went away"
    assert client.in_flight == [0, 0]
    assert after < asked // 2, f"{after} of {asked} tokens decoded"


async def test_a_replica_down_before_the_first_delta_is_failed_over(replicas):
    remotes = [EngineHTTPClient(t.url, api_key=KEY) for _, t in replicas]
    try:
        client = LLMServerClient(remotes)
        replicas[0][1].__exit__(None, None, None)  # replica 0 (the first choice of an idle pool) is gone
        outs = []
        for i in range(2):
            deltas = [d async for d in client.generate_stream(f"t{i}", [5, 6, 7], GREEDY)]
            assert [t for d in deltas for t in d.token_ids] == deltas[-1].output.token_ids
            outs.append(deltas[-1].output)
        assert [o.extra["replica"] for o in outs] == [1, 1]
        stats = client.stats
        assert (stats["replica_failures"], stats["retries"], stats["failed"], stats["completed"]) == (1, 1, 0, 2)
        assert client.healthy_replicas == [1]
        assert client.in_flight == [0, 0]
    finally:
        for r in remotes:
            await r.close()


async def test_a_streamed_generate_needs_the_api_key_and_is_validated(replicas):
    url = replicas[0][1].url
    async with httpx.AsyncClient(base_url=url) as http:
        body = {"request_id": "r", "prompt_ids": [1, 2], "sampling_params": GREEDY, "stream": True}
        assert (await http.post("/generate", json=body)).status_code == 401
        wrong = await http.post("/generate", json=body, headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401
        bad = await http.post("/generate", json={**body, "sampling_params": {"max_tokns": 3}},
                              headers={"Authorization": f"Bearer {KEY}"})
        assert bad.status_code == 400
        assert "max_tokns" in bad.json()["error"]["message"]
        not_bool = await http.post("/generate", json={**body, "stream": "yes"},
                                   headers={"Authorization": f"Bearer {KEY}"})
        assert not_bool.status_code == 400
    keyless = EngineHTTPClient(url)
    try:
        with pytest.raises(PermissionError, match="401"):
            await _collect(keyless.generate_stream("r", [1, 2], GREEDY), [])
    finally:
        await keyless.close()


async def test_a_replica_restarted_since_a_push_is_not_streamed_from(replicas, old_weights):
    """An engine server that restarted (from its checkpoint) after a weight push shows a new
    instance in the headers of its streamed answer: the stream is closed before its first
    delta is handed on, the replica becomes stale, and the request is served elsewhere."""
    (engine0, thread0), (_, thread1) = replicas
    remotes = [EngineHTTPClient(t.url, api_key=KEY, control_key=t.control_key) for t in (thread0, thread1)]
    try:
        client = LLMServerClient(remotes)
        first = [d async for d in client.generate_stream("x", [5, 6, 7], GREEDY)]
        assert first[-1].output.extra["replica"] == 0
        await client.update_weights(old_weights.items())
        port = int(thread0.url.rsplit(":", 1)[1].split("/")[0])
        thread0.__exit__(None, None, None)
        with ServerThread(engine0, port=port, api_key=KEY, control_key=thread0.control_key) as restarted:
            assert restarted.url == thread0.url
            again = [d async for d in client.generate_stream("x", [5, 6, 7], GREEDY)]  # sticky to replica 0
            assert again[-1].output.extra["replica"] == 1
            assert [t for d in again for t in d.token_ids] == again[-1].output.token_ids
            assert client.stats["stale"] == [True, False]
            assert client.in_flight == [0, 0]
            deadline = time.monotonic() + 30
            while engine0._by_id and time.monotonic() < deadline:  # noqa: ASYNC110 - another thread's engine; no event to wait on
                await asyncio.sleep(0.02)
            assert not engine0._by_id
    finally:
        for r in remotes:
            await r.close()


# ---- failures mid-stream (scripted streams) -------------------------------------------------


class Script(AsyncServerBase):
    """Streams ``[1]``, then fails (``fail``), stalls until closed (``stall``) or ends."""

    def __init__(self, after_first: str = "end") -> None:
        self.vocab_size = 100
        self.max_model_len = 64
        self.after_first = after_first
        self.closed = 0

    async def _generate(self, request_id: str, prompt_ids: list[int], sp: SamplingParams) -> TokenOutput:
        return TokenOutput(token_ids=[1, 2], log_probs=None, stop_reason="length")

    async def _generate_stream(self, request_id: str, prompt_ids: list[int], sp: SamplingParams):
        try:
            yield TokenDelta([1])
            if self.after_first == "fail":
                raise ConnectionError("replica went away mid-stream")
            if self.after_first == "stall":
                await asyncio.Event().wait()
            yield TokenDelta([2], None, TokenOutput(token_ids=[1, 2], log_probs=None, stop_reason="length"))
        finally:
            self.closed += 1


async def test_remote_stream_errors_are_mapped_as_generates_are():
    """Over HTTP: 503 with Retry-After at the in-flight limit is ReplicaBusyError (before any
    delta); an engine failure after the first record is a EngineHTTPError in the stream."""
    stalled = Script("stall")
    with ServerThread(stalled, limits=ServerLimits(max_in_flight=1)) as t, \
            ServerThread(Script("fail")) as failing_thread:
        remote, failing = EngineHTTPClient(t.url), EngineHTTPClient(failing_thread.url)
        try:
            holder = remote.generate_stream("held", [3], {"max_tokens": 2})
            assert (await anext(holder)).token_ids == [1]
            with pytest.raises(ReplicaBusyError):
                await anext(remote.generate_stream("second", [3], {"max_tokens": 2}))
            await holder.aclose()
            got: list[list[int]] = []
            with pytest.raises(EngineHTTPError, match="mid-stream"):
                await _collect(failing.generate_stream("r", [3], {"max_tokens": 2}), got)
            assert got == [[1]]
        finally:
            await remote.close()
            await failing.close()
        deadline = time.monotonic() + 30
        while stalled.closed < 1 and time.monotonic() < deadline:  # noqa: ASYNC110 - another thread's engine
            await asyncio.sleep(0.02)
        assert stalled.closed == 1  # only the held stream reached the engine; the 503 was the guard


async def test_a_failure_after_the_first_delta_is_not_retried():
    """The tokens already yielded cannot be taken back: the error reaches the caller, nothing is
    re-sent to the other replica, and the dead replica leaves rotation."""
    failing, other = Script("fail"), Script()
    client = LLMServerClient([failing, other])
    got: list[list[int]] = []
    with pytest.raises(ConnectionError, match="mid-stream"):
        await _collect(client.generate_stream("r", [3], {"max_tokens": 2}), got)
    assert got == [[1]]
    stats = client.stats
    assert (stats["retries"], stats["failed"], stats["completed"]) == (0, 1, 0)
    assert client.healthy_replicas == [1]
    assert client.in_flight == [0, 0]
    assert other.closed == 0


async def test_a_stall_between_deltas_past_request_timeout_aborts_and_raises():
    stalled = Script("stall")
    client = LLMServerClient([stalled, Script()], request_timeout_s=0.2)
    with pytest.raises(RequestTimeoutError, match="after streaming 1"):
        await _collect(client.generate_stream("r", [3], {"max_tokens": 2}), [])
    await client.close()
    assert stalled.closed == 1  # its stream was closed: the request stopped there
    assert client.in_flight == [0, 0]
    assert client.stats["retries"] == 0
    assert client.stats["timeouts"] == 1


async def test_closing_a_routed_stream_closes_the_replicas_and_frees_its_slot():
    engine = Script("stall")
    client = LLMServerClient([engine])
    stream = client.generate_stream("r", [3], {"max_tokens": 2})
    assert (await anext(stream)).token_ids == [1]
    assert client.in_flight == [1]
    await stream.aclose()
    assert engine.closed == 1
    assert client.in_flight == [0]
    assert client.stats["completed"] == 0
    assert client.stats["failed"] == 0
