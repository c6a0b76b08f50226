"""Per-trajectory sampling seeds: the SeededServer wrapper and the worker's sampling_seed key."""

from __future__ import annotations

import asyncio
import pickle

import pytest

import agentloop_core.testing.loops  # noqa: F401  registers test_chat
from agentloop_core.protocol import SamplingParams
from agentloop_core.runtime import (
    AgentLoopManager,
    AgentLoopWorker,
    SeededServer,
    derive_seed,
    sample_seed_scope,
)
from agentloop_core.testing import ScriptedServer, load_tiny_tokenizer
from agentloop_core.testing.loops import TEST_CHAT_AGENT


@pytest.fixture(scope="module")
def tokenizer():
    return load_tiny_tokenizer()


def test_derive_seed_is_stable_63_bit_and_depends_on_every_part():
    seed = derive_seed(7, "step=1/validate=False/sample=3", 0)
    assert 0 <= seed < 2**63
    # A fixed value: the derivation must not change between releases, or old runs stop reproducing.
    assert seed == derive_seed(7, "step=1/validate=False/sample=3", 0)
    others = {derive_seed(8, "step=1/validate=False/sample=3", 0), derive_seed(7, "step=1/validate=False/sample=4", 0),
              derive_seed(7, "step=1/validate=False/sample=3", 1)}
    assert seed not in others
    assert len(others) == 3


async def test_seeded_server_fills_missing_seeds_per_sample_and_call():
    inner = ScriptedServer()
    server = SeededServer(inner, 11)
    with sample_seed_scope("sample-a"):
        await server.generate("r1", [1, 2], {"max_tokens": 2})
        await server.generate("r2", [1, 2, 3], {"max_tokens": 2})  # the loop's id does not matter
        await server.generate("r1", [1], {"max_tokens": 2, "seed": 5})  # explicit seed wins
    with sample_seed_scope("sample-b"):
        await server.generate("r1", [1, 2], SamplingParams(max_tokens=2))
    seeds = [c.sampling_params.seed for c in inner.calls]
    assert seeds == [derive_seed(11, "sample-a", 0), derive_seed(11, "sample-a", 1), 5, derive_seed(11, "sample-b", 0)]


async def test_seeded_server_outside_a_sample_counts_calls_per_request_id():
    inner = ScriptedServer()
    server = SeededServer(inner, 3)
    await server.generate("x", [1], {"max_tokens": 1})
    await server.generate("y", [1], {"max_tokens": 1})
    await server.generate("x", [1], {"max_tokens": 1})
    assert [c.sampling_params.seed for c in inner.calls] == [
        derive_seed(3, "request:x", 0), derive_seed(3, "request:y", 0), derive_seed(3, "request:x", 1)
    ]


async def test_seeded_server_forwards_the_rest_and_pickles():
    inner = ScriptedServer()
    server = SeededServer(inner, 1)
    assert server.capabilities is inner.capabilities
    await server.abort("gone")
    assert "gone" in inner._aborted
    assert server.vocab_size == inner.vocab_size
    clone = pickle.loads(pickle.dumps(server))
    assert clone.sampling_seed == 1
    assert isinstance(clone.server, ScriptedServer)
    with pytest.raises(ValueError, match="sampling_seed must be an integer"):
        SeededServer(inner, "7")  # type: ignore[arg-type]


async def test_concurrent_samples_keep_their_own_counters():
    inner = ScriptedServer(latency_s=0.01)
    server = SeededServer(inner, 2)

    async def sample(key: str) -> None:
        with sample_seed_scope(key):
            for _ in range(3):
                await server.generate(key, [1], {"max_tokens": 1})

    await asyncio.gather(*(sample(k) for k in ("a", "b", "c")))
    by_key: dict[str, list[int]] = {}
    for call in inner.calls:
        by_key.setdefault(call.request_id, []).append(call.sampling_params.seed)
    for key, seeds in by_key.items():
        assert seeds == [derive_seed(2, key, i) for i in range(3)]


CONFIG = {"default_agent_loop": TEST_CHAT_AGENT, "sampling_params": {"max_tokens": 6}, "sampling_seed": 1234}


def rows(n: int) -> list[dict]:
    out = [{"raw_prompt": [{"role": "user", "content": f"q {i % 3}"}]} for i in range(n)]
    for i in range(0, n, 3):
        out[i]["observation"] = "tool says hi"  # two generate calls in those samples
    return out


def test_worker_seeds_do_not_depend_on_chunking(tokenizer):
    data = rows(9)
    one = AgentLoopManager(ScriptedServer(), tokenizer, CONFIG, num_workers=1).generate_sequences(data, step=2)
    three = AgentLoopManager(ScriptedServer(), tokenizer, CONFIG, num_workers=3).generate_sequences(data, step=2)
    assert one.responses.tolist() == three.responses.tolist()
    # Equal prompts (rows 0/3/6 repeat) still get different seeds, so different samples.
    assert one.responses[1].tolist() != one.responses[4].tolist()
    other_step = AgentLoopManager(ScriptedServer(), tokenizer, CONFIG, num_workers=1).generate_sequences(data, step=3)
    assert other_step.responses.tolist() != one.responses.tolist()


def test_worker_seed_key_uses_row_request_ids_across_orderings(tokenizer):
    data = rows(6)
    for i, row in enumerate(data):
        row["request_id"] = f"id-{i}"
    forward = AgentLoopManager(ScriptedServer(), tokenizer, CONFIG).generate_sequences(data, step=0)
    backward = AgentLoopManager(ScriptedServer(), tokenizer, CONFIG, num_workers=2).generate_sequences(data[::-1], step=0)
    assert forward.responses.tolist() == backward.responses.tolist()[::-1]


def test_without_sampling_seed_the_server_is_not_wrapped_and_bad_seeds_fail(tokenizer):
    server = ScriptedServer()
    assert AgentLoopWorker(server, tokenizer, {}).loop_server is server
    assert isinstance(AgentLoopWorker(server, tokenizer, {"sampling_seed": 0}).loop_server, SeededServer)
    with pytest.raises(ValueError, match="sampling_seed must be an integer or None, got 1.5"):
        AgentLoopWorker(server, tokenizer, {"sampling_seed": 1.5})
