"""HFServer's key/value buffers: finished rows leave the cache in place (only the rows that must
move, move), a merge writes both batches into one buffer with room, and a batch whose rows
finish and join at different steps still gives each request the tokens it gets alone."""

from __future__ import annotations

import asyncio
import collections

import pytest

torch = pytest.importorskip("torch", reason='HFServer needs pip install "agentloop-engines[hf]"')
pytest.importorskip("transformers", reason='HFServer needs pip install "agentloop-engines[hf]"')

from agentloop_core.protocol import SamplingParams  # noqa: E402
from agentloop_engines.adapters.hf import HFServer  # noqa: E402
from agentloop_engines.adapters.hf.batch import DecodeBatch, Row, _fill_from_the_end  # noqa: E402
from agentloop_engines.adapters.hf.growing_cache import GROW_TOKENS, grow_in_place, merge_layers  # noqa: E402
from agentloop_engines.adapters.hf.prefix_cache import PrefixCache  # noqa: E402
from agentloop_engines.adapters.hf.sampling import RowSampling  # noqa: E402


def _layer(rows: int, length: int = 5, heads: int = 2, dim: int = 4, seed: int = 0):
    """A growing layer holding ``rows`` rows of random keys/values, after one decode step (so
    it writes into a buffer with room), and those keys and values."""
    from transformers.cache_utils import DynamicLayer

    gen = torch.Generator().manual_seed(seed)
    keys, values = (torch.randn(rows, heads, length, dim, generator=gen) for _ in range(2))
    layer = DynamicLayer()
    layer.lazy_initialization(keys, values)
    layer.keys, layer.values = keys.clone(), values.clone()

    class Cache:
        layers = [layer]

    assert grow_in_place(Cache()) == 1
    step_k, step_v = (torch.randn(rows, heads, 1, dim, generator=gen) for _ in range(2))
    layer.update(step_k, step_v)
    return layer, torch.cat([keys, step_k], dim=-2), torch.cat([values, step_v], dim=-2)


def test_the_last_rows_fill_the_places_of_finished_ones():
    assert _fill_from_the_end([0, 2, 3, 6, 7]) == [0, 7, 2, 3, 6]
    assert _fill_from_the_end([0, 1, 2]) == [0, 1, 2]
    assert _fill_from_the_end([5]) == [5]
    order = _fill_from_the_end([1, 4, 5, 9])
    assert sorted(order) == [1, 4, 5, 9]
    assert all(j >= i for i, j in enumerate(order))


def test_finished_rows_are_dropped_in_place():
    layer, keys, values = _layer(8)
    buffer = layer.__dict__["_k"].buffer.data_ptr()
    order = _fill_from_the_end([0, 2, 3, 6, 7])
    layer.batch_select_indices(torch.tensor(order))
    assert torch.equal(layer.keys, keys[order])
    assert torch.equal(layer.values, values[order])
    assert layer.__dict__["_k"].buffer.data_ptr() == buffer, "dropping rows must not copy the cache"
    step = torch.randn(5, 2, 1, 4)
    got, _ = layer.update(step, step.clone())
    assert torch.equal(got, torch.cat([keys[order], step], dim=-2))
    assert layer.__dict__["_k"].buffer.data_ptr() == buffer, "the room left must still be used"


def test_rows_in_any_other_order_are_gathered_into_a_buffer_with_room():
    layer, keys, values = _layer(3)
    layer.batch_select_indices(torch.tensor([2, 2, 0, 1]))  # a repeat and a move up
    assert torch.equal(layer.keys, keys[[2, 2, 0, 1]])
    assert torch.equal(layer.values, values[[2, 2, 0, 1]])
    buffer = layer.__dict__["_v"].buffer.data_ptr()
    step = torch.randn(4, 2, 1, 4)
    _, got = layer.update(step.clone(), step)
    assert torch.equal(got, torch.cat([values[[2, 2, 0, 1]], step], dim=-2))
    assert layer.__dict__["_v"].buffer.data_ptr() == buffer


def test_a_gather_from_a_cache_without_room_gives_it_room():
    from transformers.cache_utils import DynamicLayer

    keys = torch.randn(2, 2, 5, 4)
    layer = DynamicLayer()
    layer.lazy_initialization(keys, keys)
    layer.keys, layer.values = keys, keys.clone()

    class Cache:
        layers = [layer]

    grow_in_place(Cache())  # as after a prefill's forward: no room yet
    layer.batch_select_indices(torch.tensor([1, 0, 0]))  # a GRPO group's copies of its prompt
    assert layer.__dict__["_k"].buffer.shape[-2] >= 5 + GROW_TOKENS
    buffer = layer.__dict__["_k"].buffer.data_ptr()
    step = torch.randn(3, 2, 1, 4)
    got, _ = layer.update(step, step.clone())
    assert torch.equal(got, torch.cat([keys[[1, 0, 0]], step], dim=-2))
    assert layer.__dict__["_k"].buffer.data_ptr() == buffer, "the first decode step must not copy the cache"


@pytest.mark.parametrize("theirs_growing", [True, False])
def test_a_merge_is_the_left_padded_concatenation_with_room(theirs_growing):
    from transformers.cache_utils import DynamicLayer

    mine, keys, values = _layer(3, length=6)
    if theirs_growing:
        theirs, their_keys, their_values = _layer(2, length=2, seed=1)
    else:
        their_keys, their_values = torch.randn(2, 2, 3, 4), torch.randn(2, 2, 3, 4)
        theirs = DynamicLayer()
        theirs.lazy_initialization(their_keys, their_values)
        theirs.keys, theirs.values = their_keys, their_values
    width = 9
    merge_layers(mine, theirs, width)

    def padded(t):
        return torch.cat([t.new_zeros((*t.shape[:2], width - t.shape[2], t.shape[3])), t], dim=2)

    assert torch.equal(mine.keys, torch.cat([padded(keys), padded(their_keys)]))
    assert torch.equal(mine.values, torch.cat([padded(values), padded(their_values)]))
    buffer = mine.__dict__["_k"].buffer
    assert buffer.shape[-2] == width + GROW_TOKENS
    step = torch.randn(5, 2, 1, 4)
    mine.update(step, step.clone())
    assert mine.__dict__["_k"].buffer.data_ptr() == buffer.data_ptr()


def test_plain_layers_still_merge_by_concatenation():
    from transformers.cache_utils import DynamicLayer

    mine, theirs = DynamicLayer(), DynamicLayer()
    a, b = torch.randn(1, 2, 4, 4), torch.randn(2, 2, 2, 4)
    for layer, t in ((mine, a), (theirs, b)):
        layer.lazy_initialization(t, t)
        layer.keys, layer.values = t, t.clone()
    merge_layers(mine, theirs, 4)
    assert type(mine) is DynamicLayer
    keys = mine.keys
    assert keys is not None
    assert torch.equal(keys[1:, :, 2:], b)
    assert not keys[1:, :, :2].any()


async def _each_alone_and_together(server: HFServer) -> tuple[list, list]:
    params = {"temperature": 0, "ignore_eos": True, "logprobs": True}
    prompts = [[100 + i] * (3 + 4 * i) + [7, 8] for i in range(7)]
    budgets = [4 + 5 * ((i * 3) % 7) for i in range(7)]  # rows finish out of order: places refilled
    alone = [await server.generate(f"s{i}", p, {**params, "max_tokens": m})
             for i, (p, m) in enumerate(zip(prompts, budgets, strict=True))]
    calls = [asyncio.ensure_future(server.generate(f"t{i}", p, {**params, "max_tokens": m}))
             for i, (p, m) in enumerate(zip(prompts, budgets, strict=True))]
    await asyncio.sleep(0.05)
    late = [asyncio.ensure_future(server.generate(f"u{i}", prompts[i], {**params, "max_tokens": budgets[i]}))
            for i in (5, 6)]  # merged into the running batch
    together = await asyncio.gather(*calls, *late)
    return alone + [alone[5], alone[6]], list(together)


async def test_rows_that_finish_and_join_out_of_order_get_their_own_tokens(model_path):
    server = HFServer(model_path, max_batch_size=32, enable_prefix_caching=False)
    try:
        alone, together = await _each_alone_and_together(server)
    finally:
        await server.close()
    assert [t.token_ids for t in together] == [a.token_ids for a in alone]
    for t, a in zip(together, alone, strict=True):
        torch.testing.assert_close(torch.tensor(t.log_probs), torch.tensor(a.log_probs), atol=1e-4, rtol=0)


def _row(request_id: str, prompt: list[int], max_tokens: int) -> Row:
    sp = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    return Row(request_id, prompt, sp, RowSampling(0.0, 0, 1.0, None), frozenset(), lambda out: None, lambda exc: None)


def _rooms(batch: DecodeBatch) -> set[int]:
    """Per layer and tensor, the free positions after the filled part of the buffer."""
    return {slot.buffer.shape[-2] - slot.length for layer in batch.cache.layers for slot in
            (layer.__dict__["_k"], layer.__dict__["_v"])}


def test_a_prefill_leaves_room_for_the_first_decode_steps(model_path):
    """A prefill with a shared prompt prefix and a GRPO group's repeats, and a next turn's prefill
    from the prefix cache, both hand the decode steps buffers with room (before, the first step
    copied every layer's cache into a grown buffer)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch.float32).eval()
    stats: dict[str, int] = collections.defaultdict(int)
    shared = list(range(40, 60))  # 20 tokens: above the shared-prefix minimum
    rows = [_row(f"r{i}", shared + [70 + i] * (1 + i % 3), 3) for i in (0, 1, 1, 2)]
    batch = DecodeBatch.prefill(model, rows, pad_id=0, device=torch.device("cpu"), stats=stats)
    assert stats["shared_prefix_tokens"] > 0
    assert stats["repeated_prompt_tokens"] > 0
    assert batch is not None
    assert min(_rooms(batch)) >= 1

    cache = PrefixCache(10_000, stats)
    first = _row("t", shared + [7, 8], 2)
    batch = DecodeBatch.prefill_all(model, [first], pad_id=0, device=torch.device("cpu"), stats=stats,
                                    image_token_id=None, prefix_cache=cache)
    while batch is not None:
        batch = batch.step(model, stats)
    second = _row("t", first.prompt_ids + first.token_ids + [9, 10, 11], 3)
    batch = DecodeBatch.prefill_all(model, [second], pad_id=0, device=torch.device("cpu"), stats=stats,
                                    image_token_id=None, prefix_cache=cache)
    assert stats["prefix_cache_hits"] == 1
    assert batch is not None
    assert min(_rooms(batch)) >= 1
