"""EngineHTTPClient: real uvicorn servers on 127.0.0.1 (ServerThread) around real HFServer engines.

Each test starts its own servers, so stopping one or changing its weights never leaks into
another test.
"""

from __future__ import annotations

import asyncio
import contextlib

import pytest

httpx = pytest.importorskip("httpx", reason='HTTP tests need: pip install "agentloop-engines[server]"')
pytest.importorskip("fastapi", reason='HTTP tests need: pip install "agentloop-engines[server]"')
pytest.importorskip("uvicorn", reason='HTTP tests need: pip install "agentloop-engines[server]"')
torch = pytest.importorskip("torch", reason='HFServer needs pip install "agentloop-engines[hf]"')
pytest.importorskip("safetensors", reason='weight sync needs pip install "agentloop-engines[hf]"')

from agentloop_core.protocol import (  # noqa: E402
    AsyncServer,
    CapabilityNotSupportedError,
    SamplingParams,
    ServerCapabilities,
    TokenOutput,
)
from agentloop_core.testing import ScriptedServer  # noqa: E402
from agentloop_engines import EngineHTTPClient  # noqa: E402
from agentloop_engines.adapters.hf import HFServer  # noqa: E402
from agentloop_engines.base import AsyncServerBase  # noqa: E402
from agentloop_engines.fleet.client import LLMServerClient, is_replica_failure  # noqa: E402
from agentloop_engines.fleet.http_client import EngineHTTPError, ReplicaUnavailableError, serialize_weights  # noqa: E402
from agentloop_engines.serving.server import ServerThread, create_app  # noqa: E402

KEY = "s3cret-key"
CONTROL = "c0ntrol-key"
"""The servers' control key (update_weights, sleep, wake_up, abort): the trainer's, not a chat client's."""
# model_path (conftest.py): the tiny model at a larger init than the training default, so greedy
# outputs depend on the prompt and "same tokens" comparisons mean something.
GREEDY = {"max_tokens": 8, "temperature": 0.0, "ignore_eos": True}
PROMPTS = [[100, 200, 300], [5, 6, 7, 8, 9, 10, 11, 12, 13], [42], [400, 401, 402, 403, 404], [7, 70, 170, 270]]


@pytest.fixture
def stack():
    with contextlib.ExitStack() as s:
        yield s


@pytest.fixture
def serve_hf(model_path, stack):
    """Start an HFServer behind a uvicorn thread; returns (engine, server thread)."""

    def start(**kwargs) -> tuple[HFServer, ServerThread]:
        engine = HFServer(model_path, max_model_len=256)
        kwargs.setdefault("api_key", KEY)
        kwargs.setdefault("control_key", CONTROL)
        return engine, stack.enter_context(ServerThread(engine, **kwargs))

    return start


@pytest.fixture
async def remote():
    """Make EngineHTTPClient clients (api_key=KEY and control_key=CONTROL unless given) and close them
    after the test."""
    made: list[EngineHTTPClient] = []

    async def make(url: str, *, connect: bool = True, **kwargs) -> EngineHTTPClient:
        server = EngineHTTPClient(url, **{"api_key": KEY, "control_key": CONTROL, **kwargs})
        made.append(server)
        if connect:
            await server.connect()
        return server

    yield make
    for server in made:
        await server.close()


async def greedy_all(server, prompts, tag: str) -> list[TokenOutput]:
    # One at a time: every request then runs as a batch of one, on both sides of a comparison.
    return [await server.generate(f"{tag}{i}", p, GREEDY) for i, p in enumerate(prompts)]


def assert_same_outputs(got: list[TokenOutput], want: list[TokenOutput], atol: float = 1e-5) -> None:
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g.token_ids == w.token_ids, f"prompt {i}: {g.token_ids} != {w.token_ids}"
        assert g.stop_reason == w.stop_reason
        assert g.log_probs == pytest.approx(w.log_probs, abs=atol)


class FlakyEngine(AsyncServerBase):
    """Fails request ids starting with 'boom'; holds ones starting with 'hold' until aborted."""

    capabilities = ServerCapabilities()

    def __init__(self) -> None:
        self.vocab_size = 1000
        self.max_model_len = 64
        self._aborts: dict[str, asyncio.Event] = {}

    async def _generate(self, request_id: str, prompt_ids: list[int], sp: SamplingParams) -> TokenOutput:
        if request_id.startswith("boom"):
            raise RuntimeError("engine fell over")
        if request_id.startswith("hold"):
            await self._aborts.setdefault(request_id, asyncio.Event()).wait()
            return TokenOutput(token_ids=[], log_probs=[], stop_reason="aborted")
        return TokenOutput(token_ids=[1, 2, 3], log_probs=[-0.5] * 3, stop_reason="length")

    async def abort(self, request_id: str) -> None:
        self._aborts.setdefault(request_id, asyncio.Event()).set()


# ---- generation ----------------------------------------------------------------------------


async def test_greedy_over_http_equals_the_in_process_engine(model_path, serve_hf, remote):
    engine, thread = serve_hf()
    server = await remote(thread.url)
    assert isinstance(server, AsyncServer)
    # Every flag, forget_session included (the server lists its route).
    assert engine.capabilities.forget_session
    assert server.capabilities == engine.capabilities
    assert (server.max_model_len, server.vocab_size) == (engine.max_model_len, engine.vocab_size)
    local = HFServer(model_path, max_model_len=256)
    try:
        want = await greedy_all(local, PROMPTS, "in")
        got = await greedy_all(server, PROMPTS, "http")
        assert len({tuple(o.token_ids) for o in want}) == len(PROMPTS), "outputs should depend on the prompt"
        assert_same_outputs(got, want)
        # A SamplingParams object travels as its fields.
        typed = await server.generate("typed", PROMPTS[0], SamplingParams(**GREEDY))
        assert typed.token_ids == want[0].token_ids
    finally:
        await server.close()
        await local.close()


# The first loop ends with its connection open (the case under test); the socket is closed when
# collected, which Python reports as an unclosed-transport ResourceWarning.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_created_outside_an_event_loop_and_used_on_successive_loops(serve_hf):
    _, thread = serve_hf()
    server = EngineHTTPClient(thread.url, api_key=KEY)
    assert server.capabilities.weight_update  # a blocking /health fetch, outside any loop

    async def then_close() -> TokenOutput:
        try:
            return await server.generate("a", PROMPTS[0], GREEDY)
        finally:
            await server.close()

    # Each asyncio.run is a new loop: the connection left open on the first cannot serve the
    # second, so the second must open its own.
    first = asyncio.run(server.generate("a", PROMPTS[0], GREEDY))
    second = asyncio.run(then_close())
    assert first.token_ids == second.token_ids
    assert len(first.token_ids) == GREEDY["max_tokens"]


# ---- LLMServerClient over HTTP replicas ----------------------------------------------------


async def test_client_spreads_trajectories_over_http_replicas_and_keeps_sessions_sticky(serve_hf, remote):
    started = [serve_hf(), serve_hf()]
    engines = [e for e, _ in started]
    client = LLMServerClient([await remote(t.url) for _, t in started])
    prompts = [[10 + i, 20, 30] for i in range(8)]
    first = await asyncio.gather(*(client.generate(f"traj{i}", p, GREEDY) for i, p in enumerate(prompts)))
    where = [o.extra["replica"] for o in first]
    assert sorted(where) == [0, 0, 0, 0, 1, 1, 1, 1], f"least in-flight should split 8 sessions 4/4: {where}"
    # Each remote engine generated exactly the tokens of the requests routed to it.
    for index, engine in enumerate(engines):
        served = sum(len(o.token_ids) for o in first if o.extra["replica"] == index)
        assert engine.stats["generated_tokens"] == served > 0

    second = await asyncio.gather(*(client.generate(f"traj{i}", p + o.token_ids + [7], GREEDY)
                                    for i, (p, o) in enumerate(zip(prompts, first, strict=True))))
    assert [o.extra["replica"] for o in second] == where, "a trajectory's second turn must stay on its replica"
    stats = client.stats
    assert (stats["new_sessions"], stats["sticky_hits"], stats["replica_failures"]) == (8, 8, 0)
    for index, engine in enumerate(engines):
        assert engine.stats["generated_tokens"] == 2 * 4 * GREEDY["max_tokens"], f"replica {index}"


async def test_a_stopped_replica_fails_over_and_no_request_is_lost(model_path, serve_hf, remote):
    started = [serve_hf(), serve_hf()]
    client = LLMServerClient([await remote(t.url) for _, t in started])
    prompts = [[50 + i, 60, 70] for i in range(6)]
    first = await asyncio.gather(*(client.generate(f"t{i}", p, GREEDY) for i, p in enumerate(prompts)))
    pinned_to_0 = sum(o.extra["replica"] == 0 for o in first)
    assert pinned_to_0 == 3

    dead = started[0][1]
    dead.__exit__(None, None, None)
    turn2 = [p + o.token_ids for p, o in zip(prompts, first, strict=True)]
    second = await asyncio.gather(*(client.generate(f"t{i}", p, GREEDY) for i, p in enumerate(turn2)))

    assert [o.extra["replica"] for o in second] == [1] * 6
    assert client.healthy_replicas == [1]
    stats = client.stats
    assert (stats["replica_failures"], stats["retries"], stats["failed"]) == (pinned_to_0, pinned_to_0, 0)
    local = HFServer(model_path, max_model_len=256)
    try:
        # The survivor ran the six together, the reference one by one: padding moves fp32
        # log-probs by ~1e-5 (tokens stay equal), as HFServer's own batching tests allow.
        assert_same_outputs(second, await greedy_all(local, turn2, "ref"), atol=1e-4)
    finally:
        await local.close()

    # The error itself: a ConnectionError naming the address, which the client counts as the
    # replica being down.
    with pytest.raises(ReplicaUnavailableError, match=dead.url) as info:
        await (await remote(dead.url, connect=False)).generate("x", [1], GREEDY)
    assert isinstance(info.value, ConnectionError)
    assert is_replica_failure(info.value)


# ---- weights, sleep and capabilities -------------------------------------------------------


async def test_update_weights_over_http_equals_loading_them_in_process(model_path, serve_hf, remote):
    started = [serve_hf(), serve_hf()]
    servers = [await remote(t.url) for _, t in started]
    local = HFServer(model_path, max_model_len=256)
    try:
        before = await greedy_all(servers[0], PROMPTS, "before")
        gen = torch.Generator().manual_seed(0)
        # named_parameters lists a tied weight once, so both sides see one consistent value.
        perturbed = {name: p.detach() + 0.5 * p.detach().std() * torch.randn(p.shape, generator=gen)
                     for name, p in local.model.named_parameters()}
        await local.update_weights(perturbed)
        state = local.model.state_dict()
        # The tiny model ties lm_head to the embedding: the push must copy the shared storage.
        assert state["lm_head.weight"].data_ptr() == state["model.embed_tokens.weight"].data_ptr()

        await LLMServerClient(servers).update_weights(list(state.items()))
        for index, (engine, _) in enumerate(started):
            remote_state = engine.model.state_dict()
            differ = [n for n, t in state.items() if not torch.equal(remote_state[n], t)]
            assert not differ, f"replica {index}: weights differ from the pushed ones: {differ}"
        after = await greedy_all(servers[0], PROMPTS, "after")
        assert [o.token_ids for o in after] != [o.token_ids for o in before], "perturbed weights changed nothing"
        assert_same_outputs(after, await greedy_all(local, PROMPTS, "local"))

        with pytest.raises(ValueError, match="no weight named 'nope'"):
            await servers[0].update_weights([("nope", torch.zeros(2))])
    finally:
        await local.close()


async def test_weights_have_their_own_body_limit(model_path, stack, remote):
    engine = HFServer(model_path, max_model_len=256)
    state = engine.model.state_dict()
    embedding = {"model.embed_tokens.weight": state["model.embed_tokens.weight"]}
    limit = len(serialize_weights(embedding)) + 4096
    assert len(serialize_weights(state)) > limit
    thread = stack.enter_context(ServerThread(engine, api_key=KEY, max_request_bytes=4096, max_weights_bytes=limit,
                                                   control_key=CONTROL))
    server = await remote(thread.url)

    await server.update_weights(embedding)  # far over max_request_bytes, under max_weights_bytes
    with pytest.raises(ValueError, match="max_weights_bytes"):
        await server.update_weights(state)
    with pytest.raises(ValueError, match="max_request_bytes"):
        await server.generate("big", [5] * 2000, GREEDY)
    assert len((await server.generate("small", [5], GREEDY)).token_ids) == GREEDY["max_tokens"]
    async with httpx.AsyncClient(base_url=thread.url, headers={"Authorization": f"Bearer {CONTROL}"}) as http:
        r = await http.post("/update_weights", content=b"not safetensors")
        assert r.status_code == 400
        assert "not a safetensors archive" in r.json()["error"]["message"]
    with pytest.raises(ValueError, match="max_weights_bytes"):
        create_app(engine, max_weights_bytes=0)


async def test_sleep_and_wake_up_over_http_keep_outputs(serve_hf, remote):
    _, thread = serve_hf()
    server = await remote(thread.url)
    before = await greedy_all(server, PROMPTS[:2], "a")
    await server.sleep()
    await server.wake_up()
    assert_same_outputs(await greedy_all(server, PROMPTS[:2], "b"), before)
    async with httpx.AsyncClient(base_url=thread.url) as http:
        for path in ("/sleep", "/wake_up", "/update_weights"):
            assert (await http.post(path)).status_code == 401, f"{path} must need the API key"


async def test_unsupported_capabilities_are_capability_not_supported(stack, remote):
    scripted = ScriptedServer()
    server = await remote(stack.enter_context(ServerThread(scripted, control_key=CONTROL)).url, api_key=None)
    assert server.capabilities == scripted.capabilities
    with pytest.raises(CapabilityNotSupportedError, match="weight_update"):
        await server.update_weights({"w": torch.zeros(2)})
    async with httpx.AsyncClient(base_url=server.base_url,  # bypass EngineHTTPClient's own check
                                 headers={"Authorization": f"Bearer {CONTROL}"}) as http:
        r = await http.post("/update_weights", content=serialize_weights({"w": torch.zeros(2)}))
        assert r.status_code == 501
        assert "weight_update" in r.json()["error"]["message"]

    flaky = await remote(stack.enter_context(ServerThread(FlakyEngine(), control_key=CONTROL)).url, api_key=None)
    with pytest.raises(CapabilityNotSupportedError, match="sleep"):
        await flaky.sleep()


# ---- errors --------------------------------------------------------------------------------


async def test_a_wrong_or_missing_api_key_is_a_permission_error(serve_hf, remote):
    _, thread = serve_hf()
    with pytest.raises(PermissionError, match="api_key given to EngineHTTPClient does not match") as info:
        await (await remote(thread.url, api_key="wrong")).generate("a", [1], GREEDY)
    assert not is_replica_failure(info.value)
    with pytest.raises(PermissionError, match=r"pass EngineHTTPClient\(\.\.\., api_key=\.\.\.\)"):
        await (await remote(thread.url, api_key=None)).generate("a", [1], GREEDY)


async def test_a_400_is_a_value_error_with_the_servers_message(serve_hf, remote):
    started = [serve_hf(), serve_hf()]
    server = await remote(started[0][1].url)
    with pytest.raises(ValueError, match="did you mean 'max_tokens'") as info:
        await server.generate("a", [1], {"max_token": 3})
    assert not is_replica_failure(info.value)
    with pytest.raises(ValueError, match="prompt_ids is empty"):
        await server.generate("a", [], GREEDY)
    # Behind the client a rejected request fails at once: no retry, no replica taken out.
    client = LLMServerClient([server, await remote(started[1][1].url)])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        await client.generate("b", [10**6], GREEDY)
    assert (client.stats["retries"], client.stats["failed"], client.healthy_replicas) == (0, 1, [0, 1])


async def test_an_engine_error_is_a_remote_engine_error_and_not_failed_over(stack, remote):
    urls = [stack.enter_context(ServerThread(FlakyEngine(), control_key=CONTROL)).url for _ in range(2)]
    client = LLMServerClient([await remote(u, api_key=None) for u in urls])
    with pytest.raises(EngineHTTPError, match="RuntimeError: engine fell over"):
        await client.generate("boom-1", [1], GREEDY)
    assert (client.stats["retries"], client.healthy_replicas) == (0, [0, 1])


async def test_a_read_timeout_is_a_timeout_error(stack, remote):
    url = stack.enter_context(ServerThread(FlakyEngine(), control_key=CONTROL)).url
    server = await remote(url, api_key=None, timeout_s=0.2)
    with pytest.raises(TimeoutError, match="timeout_s=0.2") as info:
        await server.generate("hold-1", [1], GREEDY)  # held until aborted: it can only time out
    assert is_replica_failure(info.value)
    await server.abort("hold-1")
    assert (await server.generate("ok", [1], GREEDY)).token_ids == [1, 2, 3]
