"""``forget_session``: when a trajectory is over, HFServer drops its prefix-cache entry and the
routing client its sticky slot and the pinned replica's entry, so a last turn no one will reuse
does not push out a live trajectory's entry."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason='HFServer needs pip install "agentloop-engines[hf]"')
pytest.importorskip("transformers", reason='HFServer needs pip install "agentloop-engines[hf]"')

import agentloop_core.testing.loops  # noqa: E402,F401  registers test_chat
from agentloop_core.protocol import ServerCapabilities  # noqa: E402
from agentloop_core.runtime import AgentLoopWorker  # noqa: E402
from agentloop_core.server_wrapper import TransparentServerWrapper  # noqa: E402
from agentloop_core.testing import ScriptedServer  # noqa: E402
from agentloop_core.testing.loops import TEST_CHAT_AGENT  # noqa: E402
from agentloop_engines.adapters.hf import HFServer  # noqa: E402
from agentloop_engines.fleet.client import LLMServerClient  # noqa: E402
from agentloop_engines.fleet.http_client import EngineHTTPClient  # noqa: E402

PARAMS = {"max_tokens": 5, "temperature": 0, "ignore_eos": True, "logprobs": True}


async def test_forget_drops_the_entry_and_the_next_turn_is_cold_and_exact(model_path):
    warm, cold = HFServer(model_path, prefix_cache_tokens=4096), HFServer(model_path, enable_prefix_caching=False)
    assert warm.capabilities.forget_session
    assert not cold.capabilities.forget_session
    prompt = list(range(10, 40))
    out = await warm.generate("t", prompt, PARAMS)
    assert warm.prefix_cache is not None
    assert len(warm.prefix_cache) == 1
    warm.forget_session("unknown")  # ignored
    assert len(warm.prefix_cache) == 1
    assert warm.stats["prefix_cache_forgotten"] == 0
    warm.forget_session("t")
    assert len(warm.prefix_cache) == 0
    assert warm.prefix_cache.tokens == 0
    assert warm.stats["prefix_cache_forgotten"] == 1
    following = prompt + out.token_ids + [300, 301, 302]
    again, reference = await warm.generate("t", following, PARAMS), await cold.generate("t", following, PARAMS)
    assert warm.stats["prefix_cache_hits"] == 0
    assert warm.stats["prefix_cache_misses"] == 2
    assert again.token_ids == reference.token_ids
    assert again.log_probs is not None
    assert reference.log_probs is not None
    assert max(abs(a - b) for a, b in zip(again.log_probs, reference.log_probs, strict=True)) < 1e-4
    cold.forget_session("t")  # without a cache: nothing to drop, no error


@pytest.mark.parametrize("forget", [True, False])
async def test_finished_trajectories_forgotten_leave_a_live_ones_entry_in_place(model_path, forget):
    # Room for two entries of ~35 tokens: "a" waits between its turns while "b" and "c" run
    # whole; their last turns, kept, would push "a" out.
    server = HFServer(model_path, prefix_cache_tokens=75)
    a = list(range(10, 40))
    first = await server.generate("a", a, PARAMS)
    for rid, start in (("b", 50), ("c", 90)):
        await server.generate(rid, list(range(start, start + 30)), PARAMS)
        if forget:
            server.forget_session(rid)
    assert server.stats["prefix_cache_evictions"] == (0 if forget else 1)  # "a" pushed out by "c"
    await server.generate("a", a + first.token_ids + [300, 301], PARAMS)
    assert server.stats["prefix_cache_hits"] == (1 if forget else 0)


class Keeper(ScriptedServer):
    """A replica that keeps per-trajectory state and records what it was told to forget."""

    capabilities = ServerCapabilities(logprobs=True, forget_session=True)

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.forgotten: list[str] = []

    def forget_session(self, request_id: str) -> None:
        self.forgotten.append(request_id)


async def test_the_client_frees_the_sticky_slot_and_tells_only_the_pinned_replica():
    keepers = [Keeper(), Keeper()]
    client = LLMServerClient(keepers)
    assert client.capabilities.forget_session
    for rid in ("x", "y"):
        await client.generate(rid, [1, 2, 3], {"max_tokens": 2})
    x, y = client.policy.session_replica("x"), client.policy.session_replica("y")
    assert x is not None
    assert y is not None
    assert {x, y} == {0, 1}  # one each
    client.forget_session("x")
    assert client.policy.session_replica("x") is None
    assert client.policy.session_replica("y") == y
    assert keepers[x].forgotten == ["x"]
    assert keepers[y].forgotten == []
    client.forget_session("never-seen")  # no replica to tell
    assert [k.forgotten for k in keepers if k.forgotten] == [["x"]]

    # Replicas that keep nothing per trajectory are not called; the client still frees its slot.
    plain = LLMServerClient([ScriptedServer()])
    assert plain.capabilities.forget_session
    await plain.generate("z", [1, 2], {"max_tokens": 2})
    plain.forget_session("z")
    assert plain.policy.session_replica("z") is None


def test_an_http_replica_declares_it_only_where_the_server_lists_the_route():
    client = EngineHTTPClient("http://127.0.0.1:9")
    flags = {"logprobs": True, "prefix_cache": True, "forget_session": True}
    # A server from before the route declared its engine's flag with no route to call.
    older = client._parse_health({"capabilities": flags})
    assert older["capabilities"].prefix_cache
    assert not older["capabilities"].forget_session
    assert not client._parse_health({"capabilities": flags, "optional_routes": "/forget_session"})["capabilities"].forget_session
    assert client._parse_health({"capabilities": flags, "optional_routes": ["/forget_session"]})["capabilities"].forget_session
    # The route without the engine's flag: the engine keeps nothing per trajectory.
    plain = client._parse_health({"capabilities": {**flags, "forget_session": False}, "optional_routes": ["/forget_session"]})
    assert not plain["capabilities"].forget_session


class Hiding(TransparentServerWrapper):
    """The same client, declaring no ``forget_session``: the worker as it was before."""

    @property
    def capabilities(self) -> ServerCapabilities:
        return ServerCapabilities(logprobs=True)


@pytest.mark.parametrize("told", [True, False])
async def test_a_worker_batch_leaves_the_engine_cache_empty(model_path, tokenizer, told):
    """The real chain: worker -> routing client -> HFServer, two-turn trajectories, two at a
    time; the cache is bounded to about three entries."""
    engine = HFServer(model_path, prefix_cache_tokens=150)
    client = LLMServerClient([engine])
    server = client if told else Hiding(client)
    config = {"sampling_params": {"max_tokens": 4, "temperature": 1.0}, "max_concurrent_samples": 2,
              "sampling_seed": 0}
    worker = AgentLoopWorker(server, tokenizer, config)
    rows = [{"agent_name": TEST_CHAT_AGENT, "raw_prompt": [{"role": "user", "content": f"question {i}"}],
             "observation": "the tool says 42"} for i in range(8)]
    outputs = await worker.generate_sequences(rows)
    assert not any(o.failed for o in outputs)
    assert engine.prefix_cache is not None
    assert engine.stats["prefix_cache_hits"] == 8  # every second turn reused its first
    if told:
        assert len(engine.prefix_cache) == 0
        assert engine.stats["prefix_cache_forgotten"] == 8
        assert all(client.policy.session_replica(o.extra_fields["request_id"]) is None for o in outputs)
    else:
        assert len(engine.prefix_cache) > 0
        assert engine.stats["prefix_cache_forgotten"] == 0
