"""HFServer's decode-step attention for grouped key/value heads, its in-place KV cache and its
oneDNN linear layers give what transformers' own path gives: the same attention output, the
same greedy tokens, the same cache contents, the same layer outputs (also after the weights
change)."""

from __future__ import annotations

import asyncio
import copy

import pytest

torch = pytest.importorskip("torch", reason='HFServer needs pip install "agentloop-engines[hf]"')
pytest.importorskip("transformers", reason='HFServer needs pip install "agentloop-engines[hf]"')

from agentloop_engines.adapters.hf import HFServer  # noqa: E402
from agentloop_engines.adapters.hf.attention import grouped_decode_sdpa  # noqa: E402
from agentloop_engines.adapters.hf.growing_cache import GROW_TOKENS, grow_in_place  # noqa: E402
from agentloop_engines.adapters.hf.packed_linear import pack_linears, repack  # noqa: E402


class _Attention(torch.nn.Module):
    def __init__(self, groups: int) -> None:
        super().__init__()
        self.num_key_value_groups = groups
        self.is_causal = True


def _sdpa(*args, **kwargs):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward(*args, **kwargs)


@pytest.mark.parametrize("mask_kind", ["none", "bool", "additive"])
@pytest.mark.parametrize("q_len", [1, 3])
def test_grouped_decode_attention_matches_sdpa(mask_kind, q_len):
    gen = torch.Generator().manual_seed(0)
    batch, kv_heads, groups, length, dim = 5, 3, 3, 17, 8
    module = _Attention(groups).eval()
    query = torch.randn(batch, kv_heads * groups, q_len, dim, generator=gen)
    key, value = (torch.randn(batch, kv_heads, length, dim, generator=gen) for _ in range(2))
    mask = None
    if mask_kind != "none":  # left padding: row b has b masked slots in front
        keep = torch.ones(batch, 1, q_len, length, dtype=torch.bool)
        for b in range(batch):
            keep[b, :, :, :b] = False
        mask = keep if mask_kind == "bool" else torch.zeros(keep.shape).masked_fill(~keep, torch.finfo(torch.float32).min)
    ours, _ = grouped_decode_sdpa(module, query, key, value, mask, scaling=dim ** -0.5)
    theirs, _ = _sdpa(module, query, key, value, mask, scaling=dim ** -0.5)
    assert ours.shape == theirs.shape == (batch, q_len, kv_heads * groups, dim)
    torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=1e-5)


async def _generate_all(server: HFServer) -> list:
    """Prompts of different lengths (left padding), budgets that end rows at different steps
    (rows dropped from the cache), and two requests that arrive mid-batch (merged in)."""
    params = {"temperature": 0, "ignore_eos": True, "logprobs": True}
    prompts = [[100 + i] * (3 + 4 * i) + [7, 8] for i in range(6)]
    first = [server.generate(f"a{i}", p, {**params, "max_tokens": 6 + 5 * i}) for i, p in enumerate(prompts)]
    tasks = [asyncio.ensure_future(c) for c in first]
    await asyncio.sleep(0.05)
    late = [server.generate(f"b{i}", [300 + i, 301, 302], {**params, "max_tokens": 20}) for i in range(2)]
    return await asyncio.gather(*tasks, *late)


async def test_grouped_attention_and_growing_cache_give_transformers_tokens(model_path):
    fast = HFServer(model_path, max_batch_size=32)
    plain = HFServer(model_path, max_batch_size=32, grouped_attention=False, packed_linear=False)
    try:
        assert fast.grouped_attention
        assert fast.model.config._attn_implementation != "sdpa"
        assert not plain.grouped_attention
        assert plain.model.config._attn_implementation == "sdpa"
        assert fast.packed_linears > 0
        assert plain.packed_linears == 0
        ours, theirs = await _generate_all(fast), await _generate_all(plain)
    finally:
        await fast.close()
        await plain.close()
    assert [o.token_ids for o in ours] == [t.token_ids for t in theirs]
    for o, t in zip(ours, theirs, strict=True):
        torch.testing.assert_close(torch.tensor(o.log_probs), torch.tensor(t.log_probs), atol=1e-4, rtol=0)  # as batching


def test_the_growing_cache_writes_in_place_and_holds_what_cat_would(model_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch.float32).eval()
    ids = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12], [13, 14, 15, 16]])
    with torch.inference_mode():
        out = model(input_ids=ids, use_cache=True)
        cache = out["cache"] if "cache" in out else out["past_key_values"]
        reference = [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]
        assert grow_in_place(cache) == len(cache.layers)
        layer = cache.layers[0]
        assert type(layer).__name__ == "GrowingLayer"
        pointers = set()
        for step in range(GROW_TOKENS + 3):  # past the first buffer's room: one regrowth
            k, v = torch.randn(3, *reference[0][0].shape[1:2], 1, reference[0][0].shape[-1]), None
            v = torch.randn_like(k)
            got_k, got_v = layer.update(k, v)
            reference[0] = (torch.cat([reference[0][0], k], dim=-2), torch.cat([reference[0][1], v], dim=-2))
            assert torch.equal(got_k, reference[0][0])
            assert torch.equal(got_v, reference[0][1])
            pointers.add(layer.__dict__["_k"].buffer.data_ptr())
            assert layer.get_seq_length() == 4 + step + 1
        assert len(pointers) <= 2, "each step must write into the buffer, not allocate a new cache"
        layer.batch_select_indices(torch.tensor([0, 2]))  # rows 1 finished
        assert torch.equal(layer.keys, reference[0][0][[0, 2]])
        k = torch.randn(2, *reference[0][0].shape[1:2], 1, reference[0][0].shape[-1])
        got_k, _ = layer.update(k, torch.randn_like(k))
        assert torch.equal(got_k, torch.cat([reference[0][0][[0, 2]], k], dim=-2))
        layer.crop(5 - layer.get_seq_length())  # negative: drop that many (every 5.x reads it so)
        assert layer.get_seq_length() == 5
        assert torch.equal(layer.keys, got_k[:, :, :5])


def test_only_plain_initialised_layers_are_turned():
    from transformers.cache_utils import DynamicLayer

    class Other(DynamicLayer):
        pass

    class Cache:
        layers = [DynamicLayer(), Other()]

    assert grow_in_place(Cache()) == 0  # the plain one is not initialised yet, the other is not plain
    assert type(Cache.layers[0]) is DynamicLayer
    assert type(Cache.layers[1]) is Other


def test_packed_linears_follow_every_weight_change():
    gen = torch.Generator().manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8, bias=False))
    reference = torch.nn.Sequential(*(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8, bias=False)))
    reference.load_state_dict(model.state_dict())
    assert pack_linears(model, rows_hint=4) == 2
    x = torch.randn(5, 3, 16, generator=gen)

    def same() -> None:
        with torch.inference_mode():
            torch.testing.assert_close(model(x), reference(x), atol=1e-5, rtol=1e-5)

    same()
    new = {k: torch.randn(v.shape, generator=gen) for k, v in model.state_dict().items()}
    with torch.no_grad():  # in place, as HFServer.update_weights and an optimizer step write
        for name, param in model.named_parameters():
            param.copy_(new[name])
    reference.load_state_dict(new)
    same()
    model[0].weight = torch.nn.Parameter(torch.randn(32, 16, generator=gen))  # a new tensor
    reference[0].weight = torch.nn.Parameter(model[0].weight.detach().clone())
    same()
    model[2].weight.data.copy_(torch.ones(8, 32))  # invisible to the check: repack() after it
    reference[2].weight.data.copy_(torch.ones(8, 32))
    repack(model)
    same()
    copied = copy.deepcopy(model)  # a served model copied (the trainer's export does): no oneDNN tensors in it
    with torch.inference_mode():
        torch.testing.assert_close(copied(x), reference(x), atol=1e-5, rtol=1e-5)
    # With autograd on, the layers run as loaded and gradients flow.
    model(x.requires_grad_()).sum().backward()
    assert model[0].weight.grad is not None
    assert x.grad is not None


def test_models_off_the_cpu_or_in_another_dtype_are_left_alone():
    assert pack_linears(torch.nn.Linear(4, 4).to(torch.bfloat16)) == 0
    assert pack_linears(torch.nn.ReLU()) == 0
