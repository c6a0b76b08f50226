"""Packed (padding-free) forwards compute what padded ones do: each sequence of a packed row sees
only itself (Llama, Qwen2/3, Gemma3 with its sliding window), and the actor's log-probs, loss
and gradients equal the padded path's, with LoRA too."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from test_fsdp import _batch
from test_memory_options import _assert_same_grads, _grads

from agentloop_trainer.update import ActorConfig, PolicyBatch, PolicyGradientActor, response_log_probs
from agentloop_trainer.update.packing import packed_log_probs, packed_micro_batches, packs

LENGTHS = (7, 2, 13, 5, 9)
"""Mixed lengths, longer than the sliding window below, one of the 2-token minimum."""


def _family(name: str, attn: str = "sdpa"):
    """A tiny random model of one architecture family (float32, eval)."""
    import transformers as tf

    common = {"vocab_size": 97, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64,
              "attn_implementation": attn}
    torch.manual_seed(0)
    if name == "llama":
        model = tf.LlamaForCausalLM(tf.LlamaConfig(**common))
    elif name == "qwen2":
        model = tf.Qwen2ForCausalLM(tf.Qwen2Config(**common))
    elif name == "qwen3":
        model = tf.Qwen3ForCausalLM(tf.Qwen3Config(**common, head_dim=8))
    else:  # gemma3: one sliding (window 3) and one full layer, so the window shapes the result
        model = tf.Gemma3ForCausalLM(tf.Gemma3TextConfig(**common, head_dim=8, sliding_window=3,
                                                         layer_types=["sliding_attention", "full_attention"]))
    return model.float().eval()


def _alone(model, seq: list[int]) -> torch.Tensor:
    """log p(seq[t+1] | seq[:t+1]) with the sequence run by itself, batch 1, no mask."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([seq]), use_cache=False).logits[0, :-1].float()
    return logits.log_softmax(-1).gather(-1, torch.tensor(seq[1:]).unsqueeze(-1)).squeeze(-1)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "gemma3"])
def test_a_token_in_a_packed_row_has_its_log_prob_alone(family, attn):
    """Every token's log-prob in the packed row equals the one its sequence gives alone (1e-5):
    no attention across sequences, positions restart per sequence, and Gemma3's sliding window
    is counted from each sequence's own start. sdpa runs per sequence (packed_sdpa_attention);
    eager gets transformers' block-diagonal mask. On a failure, print the per-sequence diffs: a
    later sequence off and the first exact means attention leaks across the boundary."""
    model = _family(family, attn)
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, 97, (n,), generator=g).tolist() for n in LENGTHS]
    with torch.no_grad():
        packed = packed_log_probs(model, seqs, [1] * len(seqs))
    for b, s in enumerate(seqs):
        torch.testing.assert_close(packed[b, : len(s) - 1], _alone(model, s), atol=1e-5, rtol=0, msg=f"row {b}")
        assert not packed[b, len(s) - 1 :].any(), "entries past a row's end are 0"


def test_sliding_window_matters_in_the_isolation_test():
    """Guard for the test above: Gemma3's window changes the log-probs of a sequence longer than
    it, so a packed forward that ignored the window would fail there."""
    model = _family("gemma3")
    seq = torch.randint(0, 97, (13,), generator=torch.Generator().manual_seed(1)).tolist()
    windowed = _alone(model, seq)
    model.config.sliding_window = 64
    for layer in model.model.layers:
        attn: Any = layer.self_attn
        attn.sliding_window = 64 if attn.sliding_window else None
    assert (windowed[4:] - _alone(model, seq)[4:]).abs().max() > 1e-4


def test_packed_log_probs_score_from_each_prompt_end_only():
    """``first_scored`` per sequence: entries before ``first_scored - 1`` are 0, the rest exact."""
    model = _family("qwen2")
    seqs = [list(range(1, 1 + n)) for n in (6, 10)]
    with torch.no_grad():
        packed = packed_log_probs(model, seqs, [4, 1])
    assert not packed[0, :3].any()
    torch.testing.assert_close(packed[0, 3:5], _alone(model, seqs[0])[3:], atol=1e-5, rtol=0)
    torch.testing.assert_close(packed[1, :9], _alone(model, seqs[1]), atol=1e-5, rtol=0)


def _multi_turn_batch(vocab: int) -> tuple[PolicyBatch, torch.Tensor]:
    """Mixed lengths (8..60 tokens), a shared prefix, multi-turn response masks (tool-result
    spans at 0 inside the response), one failed empty row."""
    g = torch.Generator().manual_seed(3)
    prefix = torch.randint(0, vocab, (6,), generator=g).tolist()
    R = 50
    seqs, plens = [], []
    mask = torch.zeros(7, R)
    for b, (p, r) in enumerate([(8, 4), (10, 50), (7, 3), (12, 30), (9, 12), (6, 1), (0, 0)]):
        if p == 0:
            seqs.append([])
            plens.append(0)
            continue
        seqs.append(prefix + torch.randint(0, vocab, (p - 6 + r,), generator=g).tolist())
        plens.append(p)
        mask[b, :r] = 1.0
        if r > 10:  # a tool result inside the response: its tokens are context, not trained
            mask[b, r // 3 : r // 2] = 0.0
    return PolicyBatch(seqs, plens, mask, torch.zeros(7, R)), torch.randn(7, generator=g)


def test_packed_response_log_probs_equal_padded_on_a_multi_turn_batch(random_model_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(random_model_path)).eval()
    pb, _ = _multi_turn_batch(model.config.vocab_size)
    with torch.no_grad():
        padded = response_log_probs(model, pb, temperature=0.7, share_prompts=True)
        packed = response_log_probs(model, pb, temperature=0.7, packed=True)
    assert (padded * pb.response_mask).abs().sum() > 0
    torch.testing.assert_close(packed * pb.response_mask, padded * pb.response_mask, atol=1e-5, rtol=0)


@pytest.mark.parametrize("micro", [{}, {"ppo_micro_batch_size_per_gpu": 3},
                                   {"use_dynamic_bsz": True, "ppo_max_token_len_per_gpu": 70}])
def test_packed_update_gives_the_padded_loss_and_gradients(random_model_path, micro):
    """One update (lr 0) packed and padded: same old log-probs, pg_loss and per-parameter
    gradients, whole share in one pass, by row count and by token budget."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(random_model_path))
    pb, adv = _multi_turn_batch(model.config.vocab_size)
    padded, m_padded = _grads(copy.deepcopy(model), pb, adv, use_remove_padding=False, **micro)
    packed, m_packed = _grads(model, pb, adv, use_remove_padding=True, **micro)
    _assert_same_grads(padded, packed, atol=1e-5)
    assert m_packed["actor/pg_loss"] == pytest.approx(m_padded["actor/pg_loss"], rel=1e-5, abs=1e-7)
    assert m_packed["actor/ppo_kl"] == pytest.approx(m_padded["actor/ppo_kl"], abs=1e-6)
    if micro.get("use_dynamic_bsz"):
        # 70 tokens a pass: the packed rows hold what padding would waste, so fewer passes
        assert m_packed["actor/micro_batches"] < m_padded["actor/micro_batches"]


def test_packed_update_with_lora_and_its_adapter_disabled_reference(random_model_path):
    """LoRA: the packed update's gradients (adapters only) and the KL to the adapter-disabled
    base equal the padded ones."""
    from transformers import AutoModelForCausalLM

    from agentloop_trainer.policy import apply_lora

    base = AutoModelForCausalLM.from_pretrained(str(random_model_path))
    pb, adv = _batch(base.config.vocab_size)
    out = []
    for packed in (False, True):
        torch.manual_seed(0)  # the adapters' initial A matrices
        model = apply_lora(copy.deepcopy(base), 4, 8, ["q_proj", "v_proj", "up_proj"])
        actor = PolicyGradientActor(model, ActorConfig(lr=5e-2, tis_cap=None, use_kl_loss=True, kl_loss_coef=0.5,
                                                       use_remove_padding=packed))
        assert actor.packed is packed
        metrics = [actor.update(pb, adv, ref_log_probs=actor.reference_log_probs(pb)) for _ in range(2)]
        out.append([(m["actor/pg_loss"], m["actor/kl_loss"], m["actor/grad_norm"]) for m in metrics])
    assert out[0][1][1] > 0, "the adapters moved: the KL to the base is positive"
    for a, b in zip(out[0], out[1], strict=True):
        assert b == pytest.approx(a, rel=1e-4, abs=1e-7)


def test_packed_micro_batches_cover_every_row_once_within_the_budget():
    g = torch.Generator().manual_seed(0)
    lengths = [int(n) for n in torch.randint(1, 300, (40,), generator=g)] + [900]
    rows = list(range(3, 40))
    parts = packed_micro_batches(rows, lengths, 512)
    assert sorted(r for p in parts for r in p) == rows
    assert all(sum(lengths[r] for r in p) <= 512 for p in parts)
    # first-fit decreasing leaves at most one micro-batch less than half full
    assert sum(sum(lengths[r] for r in p) < 256 for p in parts) <= 1
    assert packed_micro_batches([40, 0], lengths, 512)[0] == [40], "a row over the budget gets its own"
    with pytest.raises(ValueError, match="ppo_max_token_len_per_gpu"):
        packed_micro_batches(rows, lengths, 0)


def test_vision_models_stay_padded():
    """A vision-language config (``vision_config``) keeps the padded path; a text model packs."""
    model = _family("qwen2")
    assert packs(model)
    model.config.vision_config = {"depth": 1}
    assert not packs(model)
    assert not PolicyGradientActor(model, ActorConfig(use_remove_padding=True)).packed


def test_a_model_that_drops_attention_kwargs_is_refused():
    """A packed forward whose attention never saw ``cu_seq_lens_q`` would attend across the
    sequences (the stand-in mask hides the boundaries): it raises, naming the switch."""
    model = _family("qwen2")
    forward = model.forward

    def dropping(*args, cu_seq_lens_q=None, cu_seq_lens_k=None, max_length_q=None, max_length_k=None, **kw):
        return forward(*args, **kw)

    model.forward = dropping
    with pytest.raises(RuntimeError, match="use_remove_padding=false"):
        packed_log_probs(model, [[1, 2, 3], [4, 5]], [1, 1])


def _group_batch(vocab: int, prompts: int = 2, n: int = 4, prompt_len: int = 40, answer: int = 5) -> PolicyBatch:
    """A GRPO batch: ``prompts`` long prompts, ``n`` short answers each (the main job's shape)."""
    g = torch.Generator().manual_seed(5)
    seqs, plens = [], []
    for _ in range(prompts):
        prompt = torch.randint(0, vocab, (prompt_len,), generator=g).tolist()
        for _ in range(n):
            seqs.append(prompt + torch.randint(0, vocab, (answer,), generator=g).tolist())
            plens.append(prompt_len)
    mask = torch.ones(len(seqs), answer)
    return PolicyBatch(seqs, plens, mask, torch.zeros(len(seqs), answer))


def test_packing_pays_only_where_it_computes_fewer_tokens(random_model_path):
    """A GRPO group of a long prompt with short answers runs padded with each prompt once (about
    3x fewer tokens than packing every row whole: the main job's update took 4x longer packed);
    rows that share no prompt, and mixed multi-turn rows, pack."""
    from transformers import AutoModelForCausalLM

    from agentloop_trainer.update.packing import packing_pays

    model = AutoModelForCausalLM.from_pretrained(str(random_model_path))
    vocab = model.config.vocab_size
    group = _group_batch(vocab)
    rows = list(range(len(group.sequences)))
    # 8 rows x 45 tokens = 360 packed, against 2 x 39 + 8 x 6 = 126 shared.
    assert not packing_pays(group.sequences, group.prompt_lengths, rows)
    assert packing_pays(group.sequences, group.prompt_lengths, [0, 4])  # one sample of each prompt
    mixed, _ = _multi_turn_batch(vocab)
    assert packing_pays(mixed.sequences, mixed.prompt_lengths, list(range(len(mixed.sequences))))

    actor = PolicyGradientActor(model, ActorConfig(use_remove_padding=True, ppo_max_token_len_per_gpu=100))
    assert actor.packed
    assert not actor._packs(group, rows, grad=True)
    assert actor._packs(mixed, list(range(len(mixed.sequences))), grad=True)
    # Packed, the 100-token budget would split the 360 tokens into several passes; shared, the
    # whole mini-batch is one padded pass.
    metrics = actor.update(group, torch.randn(len(rows)), actor.compute_log_probs(group))
    assert metrics["actor/micro_batches"] == 1
