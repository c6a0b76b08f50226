"""Prompt-shared micro-batches cut where one long tail would pad the rest (update/tail_buckets.py)."""

from __future__ import annotations

import copy
import random

import pytest
import torch
from test_memory_options import _assert_same_grads, _grads

from agentloop_trainer.update import PolicyBatch
from agentloop_trainer.update.tail_buckets import pass_cost, shared_prompt_micro_batches


def _grpo_batch(vocab: int, groups: int = 4, n: int = 4, prompt: int = 60, outlier: int | None = 40,
                seed: int = 0) -> tuple[PolicyBatch, torch.Tensor]:
    """``groups`` prompts (a 40-token common prefix) x ``n`` samples with 5-8 token answers; one
    sample (of the second prompt) rambles to ``outlier`` tokens."""
    rng = random.Random(seed)
    common = [rng.randrange(3, vocab) for _ in range(40)]
    seqs, lengths = [], []
    for g in range(groups):
        head = common + [rng.randrange(3, vocab) for _ in range(prompt - 40 + g)]
        for k in range(n):
            answer = outlier if (outlier and (g, k) == (1, 2)) else rng.randint(5, 8)
            seqs.append(head + [rng.randrange(3, vocab) for _ in range(answer)])
            lengths.append(len(head))
    R = max(len(s) - p for s, p in zip(seqs, lengths, strict=True))
    mask = torch.zeros(len(seqs), R)
    for b, (s, p) in enumerate(zip(seqs, lengths, strict=True)):
        mask[b, : len(s) - p] = 1
    g = torch.Generator().manual_seed(seed)
    rollout = -torch.rand(len(seqs), R, generator=g) * 5 * mask
    return PolicyBatch(seqs, lengths, mask, rollout), torch.randn(len(seqs), generator=g)


def test_one_long_tail_gets_a_pass_of_its_own():
    pb, _ = _grpo_batch(1000)
    rows = list(range(len(pb.sequences)))
    parts = shared_prompt_micro_batches(pb.sequences, pb.prompt_lengths, rows)
    assert sorted(r for p in parts for r in p) == rows, "every row in exactly one micro-batch"
    assert all(p == sorted(p) for p in parts)
    assert [6] in parts, "the rambling sample (row 6) runs alone"
    split = sum(pass_cost(pb.sequences, pb.prompt_lengths, p) for p in parts)
    assert split < 0.6 * pass_cost(pb.sequences, pb.prompt_lengths, rows)  # 492 against 848


def test_rows_of_similar_length_stay_one_pass():
    pb, _ = _grpo_batch(1000, outlier=None)
    rows = list(range(len(pb.sequences)))
    assert shared_prompt_micro_batches(pb.sequences, pb.prompt_lengths, rows) == [rows]
    assert shared_prompt_micro_batches(pb.sequences, pb.prompt_lengths, [3]) == [[3]]
    assert shared_prompt_micro_batches(pb.sequences, pb.prompt_lengths, []) == []


def test_many_distinct_lengths_are_cut_within_the_candidate_bound():
    """4096 rows of 300 distinct tail lengths: the search stays bounded and covers every row."""
    rng = random.Random(1)
    head = list(range(3, 50))
    seqs = [head + [7] * rng.randint(1, 300) for _ in range(4096)]
    lengths = [len(head)] * len(seqs)
    parts = shared_prompt_micro_batches(seqs, lengths, range(len(seqs)))
    assert sorted(r for p in parts for r in p) == list(range(len(seqs)))
    assert 1 < len(parts) <= 65


def test_the_update_splits_the_outlier_and_keeps_its_gradients(random_model_path):
    """The default update (one process, prompts shared, no micro-batch size) now runs the long
    tail apart, and its loss and gradients equal the single padded pass's."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(random_model_path))
    pb, adv = _grpo_batch(model.config.vocab_size)
    one, m_one = _grads(copy.deepcopy(model), pb, adv, ppo_micro_batch_size_per_gpu=len(pb.sequences))
    split, m_split = _grads(model, pb, adv)
    assert m_one["actor/micro_batches"] == 1
    assert m_split["actor/micro_batches"] == 2
    _assert_same_grads(one, split, atol=1e-5)
    assert m_split["actor/pg_loss"] == pytest.approx(m_one["actor/pg_loss"], rel=1e-5, abs=1e-7)
