"""The GRPO step's shortcuts give the results of the long way round.

Each test pairs a shortcut with the computation it replaces: a GRPO group's prompt run once in
the update forward (``prompt_shared_log_probs``) against one padded forward; a group's prompt
prefilled once in HFServer against each sample prefilled alone; the batched exponential race
against ``torch.multinomial`` row by row. A failure means the shortcut changed what is trained
or generated: rerun the pair on the failing batch and compare row by row.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from agentloop_trainer.update import (
    MIN_SHARED_PREFIX,
    ActorConfig,
    PolicyBatch,
    PolicyGradientActor,
    prompt_groups,
    prompt_shared_log_probs,
    response_log_probs,
    sequence_log_probs,
)


def _group_batch(vocab: int, seed: int = 0, common_prefix: int = 7) -> tuple[PolicyBatch, torch.Tensor]:
    """4 prompts x 3 samples: a common prefix, prompts of different lengths (one only 2 tokens
    longer than the prefix), responses of different lengths, and one empty response."""
    g = torch.Generator().manual_seed(seed)
    common = torch.randint(3, vocab, (common_prefix,), generator=g).tolist()
    prompts = [common + torch.randint(3, vocab, (n,), generator=g).tolist() for n in (20, 23, 5, 1)]
    seqs, lengths = [], []
    for i, p in enumerate(prompts):
        for k in range(3):
            seqs.append(p + torch.randint(3, vocab, (4 + 6 * k + i,), generator=g).tolist())
            lengths.append(len(p))
    seqs.append(list(prompts[1]))  # a failed sample: prompt only
    lengths.append(len(prompts[1]))
    R = max(len(s) - p for s, p in zip(seqs, lengths, strict=True))
    mask = torch.zeros(len(seqs), R)
    for b, (s, p) in enumerate(zip(seqs, lengths, strict=True)):
        mask[b, : len(s) - p] = 1
    rollout = -torch.rand(len(seqs), R, generator=g) * 5 * mask
    return PolicyBatch(seqs, lengths, mask, rollout), torch.randn(len(seqs), generator=g)


def _model(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)


def test_prompt_groups_only_when_rows_repeat_a_prompt():
    assert prompt_groups([[1, 2, 3, 4], [1, 2, 3, 5], [1, 9, 3, 5]], [3, 3, 3]) == [0, 0, 1]
    # rows sharing all but the last prompt token share the cached part
    assert prompt_groups([[1, 2, 3, 4], [1, 2, 7, 5]], [3, 3]) == [0, 0]
    assert prompt_groups([[1, 2, 3], [4, 5, 6]], [2, 2]) is None, "no prompt repeats: nothing to share"
    assert prompt_groups([[1, 2, 3], [1, 2, 3]], [1, 1]) is None, "a 1-token prompt has no part to share"
    assert prompt_groups([[1, 2], [1, 2]], [3, 2]) is None, "a prompt longer than its sequence"


@pytest.mark.parametrize("common_prefix", [7, MIN_SHARED_PREFIX + 4], ids=["short-prefix", "prefix-pass"])
def test_prompt_shared_forward_equals_one_padded_forward_values_and_gradients(random_model_path, common_prefix):
    """Response log-probs, and the gradient of any loss on them, must match a plain padded
    forward: the shared key/value caches carry gradients back into the prompt computation
    (with and without the separate pass over the prefix common to all prompts)."""
    model = _model(random_model_path)
    pb, _ = _group_batch(model.config.vocab_size, common_prefix=common_prefix)
    weights = torch.randn(pb.response_mask.shape, generator=torch.Generator().manual_seed(1))
    outs, grads = [], []
    for share in (False, True):
        model.zero_grad(set_to_none=True)
        logp = response_log_probs(model, pb, temperature=0.7, share_prefix=share, share_prompts=share)
        (logp * weights * pb.response_mask).sum().backward()
        outs.append(logp.detach())
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    assert torch.equal(outs[1] != 0, pb.response_mask.bool()), "every response token and nothing else is scored"
    torch.testing.assert_close(outs[1], outs[0], atol=2e-5, rtol=1e-5)
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, atol=1e-5, rtol=1e-4, msg=name)
    # the grouped pass really ran (not a fallback to the padded one)
    assert prompt_groups(pb.sequences, pb.prompt_lengths) == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3, 1]


def test_prompt_shared_forward_matches_sequence_log_probs_layout(random_model_path):
    model = _model(random_model_path)
    pb, _ = _group_batch(model.config.vocab_size, seed=3, common_prefix=MIN_SHARED_PREFIX)
    groups = prompt_groups(pb.sequences, pb.prompt_lengths)
    with torch.no_grad():
        full = sequence_log_probs(model, pb.sequences, share_prefix=False)
        shared = prompt_shared_log_probs(model, pb.sequences, pb.prompt_lengths, groups)
    assert shared.shape == full.shape
    for b, p in enumerate(pb.prompt_lengths):
        torch.testing.assert_close(shared[b, p - 1 :], full[b, p - 1 :], atol=2e-5, rtol=1e-5)
        assert not shared[b, : p - 1].any()


def test_update_with_prompts_shared_equals_the_padded_update(random_model_path):
    """Two optimizer steps with the grouped forward (the default on one process) land on the
    weights the plain padded forward gives (``share_prefix_with_grad=False``)."""
    results = []
    for share in (True, False):
        model = _model(random_model_path)
        actor = PolicyGradientActor(model, ActorConfig(lr=1e-2, tis_cap=2.0, share_prefix_with_grad=share))
        pb, adv = _group_batch(model.config.vocab_size)
        metrics = [actor.update(pb, adv, None) for _ in range(2)]
        results.append((metrics, {k: v.detach().clone() for k, v in model.state_dict().items()}))
    (m_shared, w_shared), (m_plain, w_plain) = results
    for a, b in zip(m_shared, m_plain, strict=True):
        for key in ("actor/pg_loss", "actor/grad_norm", "actor/tis_weight_mean", "rollout/logprob_abs_diff_max"):
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), key
    assert m_shared[0]["actor/pg_loss"] != pytest.approx(m_shared[1]["actor/pg_loss"], abs=1e-7), "weights moved"
    for name, value in w_plain.items():
        # Adam turns rounding-level gradient differences into small steps: compare well below
        # one lr-sized (1e-2) update
        assert float((w_shared[name] - value).abs().max()) < 1e-3, name


def test_batched_exponential_race_draws_what_multinomial_draws():
    from agentloop_engines.adapters.hf.sampling import _draw

    probs = torch.softmax(torch.randn(16, 300, generator=torch.Generator().manual_seed(0)) * 4, dim=-1)
    probs[3, 10:] = 0.0  # a top-k style row
    probs[3] /= probs[3].sum()
    for step in range(3):
        seeds = [1000 * step + j for j in range(16)]
        expected = [int(torch.multinomial(probs[j], 1, generator=torch.Generator().manual_seed(s))[0])
                    for j, s in enumerate(seeds)]
        got = _draw(probs, [torch.Generator().manual_seed(s) for s in seeds]).tolist()
        assert got == expected
    bad = probs.clone()
    bad[2, 5] = float("nan")
    with pytest.raises(ValueError, match="inf, nan or a negative"):
        _draw(bad, [None] * 16)


def test_hf_server_prefills_a_group_prompt_once_with_unchanged_samples(random_model_path, tokenizer):
    """A GRPO group (one prompt, several seeded samples) in one batch: the prompt is prefilled
    once, and each sample equals the one the same seed draws alone."""
    from agentloop_engines import HFServer

    prompts = [tokenizer.encode(f"What is {a} + {a}?", add_special_tokens=False) for a in (3, 12)]
    params = {"max_tokens": 8, "temperature": 1.0, "top_k": -1, "logprobs": True, "ignore_eos": True}

    async def run() -> tuple[list, list, dict]:
        grouped = HFServer(str(random_model_path), max_batch_size=16, batch_wait_s=0.05)
        outs = await asyncio.gather(*(grouped.generate(f"{i}-{k}", prompts[i], {**params, "seed": 10 * i + k})
                                      for i in range(2) for k in range(3)))
        alone = HFServer(str(random_model_path), max_batch_size=1)
        refs = [await alone.generate("ref", prompts[i], {**params, "seed": 10 * i + k})
                for i in range(2) for k in range(3)]
        stats = dict(grouped.stats)
        await grouped.close()
        await alone.close()
        return outs, refs, stats

    outs, refs, stats = asyncio.run(run())
    assert stats["repeated_prompt_tokens"] == 2 * sum(map(len, prompts))
    assert stats["prefill_tokens"] == sum(map(len, prompts))
    assert len({tuple(o.token_ids) for o in outs}) > 2, "different seeds must sample different completions"
    for out, ref in zip(outs, refs, strict=True):
        assert out.token_ids == ref.token_ids
        assert out.log_probs == pytest.approx(ref.log_probs, abs=1e-4)
