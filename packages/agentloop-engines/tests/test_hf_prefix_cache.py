"""HFServer's prefix reuse across turns (``enable_prefix_caching``, on by default; bound:
``prefix_cache_tokens``): a trajectory's next turn
prefills only its new tokens, and its tokens and log-probs equal a cold prefill's.

Debugging a failure: compare ``server.stats`` (``prefill_tokens``, ``prefix_cache_*``) of the
two servers; a log-prob mismatch with the expected hit counts points at the positions or mask
built by ``agentloop_engines.adapters.hf.prefix_cache.hit_inputs``; wrong counts at ``PrefixCache.take``
/ ``store`` (called from ``DecodeBatch._sample`` when a row finishes).
"""

from __future__ import annotations

import asyncio

import pytest

torch = pytest.importorskip("torch", reason='HFServer needs pip install "agentloop-engines[hf]"')
pytest.importorskip("transformers", reason='HFServer needs pip install "agentloop-engines[hf]"')

from agentloop_core.protocol import TokenOutput  # noqa: E402
from agentloop_engines.adapters.hf import HFServer  # noqa: E402

PARAMS = {"max_tokens": 6, "temperature": 0, "ignore_eos": True, "logprobs": True}
TOL = 1e-4


def _tool_result(turn: int, n: int = 5) -> list[int]:
    """Tokens a tool's answer appends after a turn (distinct per turn)."""
    return [300 + 7 * turn + i for i in range(n)]


async def _trajectory(server: HFServer, rid: str, prompt: list[int], turns: int = 5) -> list[TokenOutput]:
    """Run ``turns`` turns: each next prompt is the last prompt, its completion and a tool result."""
    outs = []
    for t in range(turns):
        out = await server.generate(rid, prompt, PARAMS)
        outs.append(out)
        prompt = prompt + out.token_ids + _tool_result(t)
    return outs


def _assert_same(cached: list[TokenOutput], cold: list[TokenOutput]) -> None:
    for turn, (a, b) in enumerate(zip(cached, cold, strict=True)):
        assert a.token_ids == b.token_ids, f"turn {turn}: greedy tokens differ with the prefix cache"
        assert a.log_probs is not None
        assert b.log_probs is not None
        diff = max(abs(x - y) for x, y in zip(a.log_probs, b.log_probs, strict=True))
        assert diff < TOL, f"turn {turn}: log-probs differ by {diff} with the prefix cache"


@pytest.fixture(scope="module")
def cold(model_path):
    return HFServer(model_path, enable_prefix_caching=False)


async def test_five_turn_trajectory_is_exact_and_prefills_only_new_tokens(model_path, cold):
    warm = HFServer(model_path, prefix_cache_tokens=4096)
    prompt = [11 + 3 * i for i in range(20)]
    cached, reference = await _trajectory(warm, "t0", prompt), await _trajectory(cold, "t0", prompt)
    _assert_same(cached, reference)
    stats = warm.stats
    assert (stats["prefix_cache_hits"], stats["prefix_cache_misses"]) == (4, 1)
    # Turn t reuses the last turn's prompt and completion but its last token (never fed).
    final_prompt = len(prompt) + sum(len(o.token_ids) + 5 for o in cached[:-1])
    assert stats["prefill_tokens"] == final_prompt - sum(len(o.token_ids) - 1 for o in cached[:-1])
    assert stats["prefix_cache_tokens_reused"] == sum(
        len(prompt) + sum(len(o.token_ids) + 5 for o in cached[:t]) - 1 - 5 for t in range(1, 5))
    assert len(warm.prefix_cache or ()) == 1
    assert warm.capabilities.prefix_cache
    assert not cold.capabilities.prefix_cache


async def test_concurrent_trajectories_of_different_lengths_batch_their_hits_exactly(model_path, cold):
    warm = HFServer(model_path, prefix_cache_tokens=4096)
    prompts = [[5 + i for i in range(n)] for n in (4, 17, 33)]
    cached = await asyncio.gather(*(_trajectory(warm, f"c{i}", p) for i, p in enumerate(prompts)))
    reference = await asyncio.gather(*(_trajectory(cold, f"c{i}", p) for i, p in enumerate(prompts)))
    for a, b in zip(cached, reference, strict=True):
        _assert_same(a, b)
    assert warm.stats["prefix_cache_hits"] == 3 * 4
    assert warm.stats["max_batch_rows"] > 1, "the trajectories' turns should have shared forward passes"


async def test_prompt_that_diverges_is_a_miss_or_a_partial_hit_and_stays_exact(model_path, cold):
    warm = HFServer(model_path, prefix_cache_tokens=4096)
    prompt = list(range(40, 70))
    first = await warm.generate("d", prompt, PARAMS)
    other = [599] + prompt[1:] + first.token_ids  # differs at the first token: nothing to reuse
    assert (await warm.generate("d", other, PARAMS)).token_ids == (await cold.generate("x", other, PARAMS)).token_ids
    assert (warm.stats["prefix_cache_hits"], warm.stats["prefix_cache_misses"]) == (0, 2)
    # The entry now holds `other` and its completion; a prompt sharing its first 10 tokens reuses them.
    partial = other[:10] + [1, 2, 3, 4]
    _assert_same([await warm.generate("d", partial, PARAMS)], [await cold.generate("x", partial, PARAMS)])
    assert (warm.stats["prefix_cache_hits"], warm.stats["prefix_cache_tokens_reused"]) == (1, 10)


async def test_weight_update_and_sleep_invalidate_the_cache(model_path, new_weights, old_weights):
    warm = HFServer(model_path, prefix_cache_tokens=4096)
    prompt = list(range(80, 100))
    first = await warm.generate("w", prompt, PARAMS)
    assert len(warm.prefix_cache or ()) == 1
    await warm.update_weights(new_weights)
    assert len(warm.prefix_cache or ()) == 0
    following = prompt + first.token_ids + _tool_result(0)
    after = await warm.generate("w", following, PARAMS)
    assert warm.stats["prefix_cache_hits"] == 0, "a cache computed with the old weights was reused"
    fresh = HFServer(model_path, enable_prefix_caching=False)
    await fresh.update_weights(new_weights)
    _assert_same([after], [await fresh.generate("w", following, PARAMS)])
    await warm.sleep()
    assert len(warm.prefix_cache or ()) == 0
    await warm.wake_up()
    await warm.update_weights(old_weights)


async def test_entries_are_evicted_least_recently_used_under_the_token_bound(model_path, cold):
    warm = HFServer(model_path, prefix_cache_tokens=60)
    a, b = list(range(10, 40)), list(range(50, 80))  # 30 + 5 held tokens each: both cannot stay
    out_a = await warm.generate("a", a, PARAMS)
    await warm.generate("b", b, PARAMS)
    assert warm.stats["prefix_cache_evictions"] == 1
    assert warm.prefix_cache is not None
    assert warm.prefix_cache.tokens <= 60
    following = a + out_a.token_ids + _tool_result(0)
    again = await warm.generate("a", following, PARAMS)  # "a" was evicted: cold, still exact
    assert warm.stats["prefix_cache_hits"] == 0
    _assert_same([again], [await cold.generate("a", following, PARAMS)])


async def test_on_by_default_bounded_by_bytes_and_off_on_request(model_path):
    from agentloop_engines.adapters.hf.prefix_cache import DEFAULT_PREFIX_CACHE_BYTES, kv_bytes_per_token

    default = HFServer(model_path)
    assert default.prefix_cache is not None
    assert default.capabilities.prefix_cache
    config = default.model.config
    per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * (
        config.hidden_size // config.num_attention_heads) * 4  # float32
    assert kv_bytes_per_token(default.model) == per_token
    assert default.prefix_cache.max_tokens == DEFAULT_PREFIX_CACHE_BYTES // per_token
    # On a CPU server sleep frees the cache, so the trainer's update gets that memory.
    assert default.capabilities.sleep is True
    server = HFServer(model_path, enable_prefix_caching=False)
    assert server.prefix_cache is None
    assert not server.capabilities.prefix_cache
    assert server.capabilities.sleep is False, "a CPU server without a cache frees nothing on sleep"
    await server.generate("o", list(range(20)), PARAMS)
    await server.generate("o", list(range(30)), PARAMS)
    assert server.stats["prefix_cache_hits"] == server.stats["prefix_cache_misses"] == 0
    with pytest.raises(ValueError, match="prefix_cache_tokens must be >= 1.*enable_prefix_caching=False"):
        HFServer(model_path, prefix_cache_tokens=0)
    with pytest.raises(ValueError, match="prefix_cache_tokens=64 with enable_prefix_caching=False"):
        HFServer(model_path, enable_prefix_caching=False, prefix_cache_tokens=64)


def test_the_default_bound_of_a_model_whose_config_does_not_give_its_shape():
    """A caller's own model object need not carry a transformers config: the bound falls back
    instead of the server failing to start."""
    from types import SimpleNamespace

    from agentloop_engines.adapters.hf.prefix_cache import FALLBACK_KV_BYTES_PER_TOKEN, kv_bytes_per_token

    bare = torch.nn.Linear(2, 2)
    assert kv_bytes_per_token(bare) == FALLBACK_KV_BYTES_PER_TOKEN
    bare.config = SimpleNamespace(hidden_size=8)  # no heads, no layers
    assert kv_bytes_per_token(bare) == FALLBACK_KV_BYTES_PER_TOKEN


@pytest.mark.parametrize("caching", [True, False])
async def test_a_trajectorys_next_turn_is_admitted_before_new_prompts(model_path, caching):
    """One row at a time and a queue: the turn whose entry waits in the cache goes first, the
    new prompts after it in their order; with the cache off, arrival order."""
    server = HFServer(model_path, max_batch_size=1, batch_wait_s=0.3, enable_prefix_caching=caching)
    a = list(range(10, 40))
    first = await server.generate("a", a, PARAMS)
    finished: list[str] = []

    async def turn(rid: str, prompt: list[int]) -> None:
        await server.generate(rid, prompt, PARAMS)
        finished.append(rid)

    # Queued in this order within the scheduler's batch wait: two new prompts, then "a".
    await asyncio.gather(turn("x", list(range(50, 80))), turn("y", list(range(90, 120))),
                         turn("a", a + first.token_ids + _tool_result(0)))
    assert finished == (["a", "x", "y"] if caching else ["x", "y", "a"])
    assert server.stats["prefix_cache_hits"] == (1 if caching else 0)
    assert server.stats["prefix_cache_evictions"] == 0
