"""Memory options change where and how the update runs, never what it computes: micro-batches
with gradient accumulation, token-budget (dynamic) micro-batches, gradient checkpointing,
bfloat16 mixed precision, LoRA and offload, each checked against the plain full-batch update."""

from __future__ import annotations

import copy

import pytest
import torch
from test_fsdp import _batch, _segmented_batch

from agentloop_trainer.update import ActorConfig, PolicyGradientActor, micro_batches


def _grads(model, pb, adv, **actor_kw) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """Gradients (and metrics) of one update with lr=0, so the weights stay put."""
    actor = PolicyGradientActor(model, ActorConfig(lr=0.0, tis_cap=2.0, **actor_kw))
    seen: dict[str, torch.Tensor] = {}
    step = actor.optimizer.step

    def keep() -> None:
        seen.update({n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None})
        step()

    actor.optimizer.step = keep
    old = actor.compute_log_probs(pb)
    metrics = actor.update(pb, adv, old)
    return seen, metrics


def _assert_same_grads(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], atol: float = 1e-6) -> None:
    assert set(a) == set(b)
    assert a
    for name in a:
        torch.testing.assert_close(b[name], a[name], atol=atol, rtol=1e-4, msg=name)


@pytest.fixture
def model(random_model_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(random_model_path))


@pytest.mark.parametrize("loss_agg_mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
@pytest.mark.parametrize("micro", [{"ppo_micro_batch_size_per_gpu": 1}, {"ppo_micro_batch_size_per_gpu": 3},
                                   {"use_dynamic_bsz": True, "ppo_max_token_len_per_gpu": 80}])
def test_accumulated_micro_batches_equal_the_full_batch_gradient(model, loss_agg_mode, micro):
    pb, adv = _batch(model.config.vocab_size)
    rollout = pb.rollout_log_probs
    pb.rollout_log_probs = rollout - 0.3 * torch.rand_like(rollout)  # a TIS weight that is not all 1
    full, m_full = _grads(model, pb, adv, loss_agg_mode=loss_agg_mode)
    parts, m_parts = _grads(model, pb, adv, loss_agg_mode=loss_agg_mode, **micro)
    assert m_parts["actor/micro_batches"] > 1
    assert m_full["actor/micro_batches"] == 1
    _assert_same_grads(full, parts)
    for key in ("actor/pg_loss", "actor/pg_clipfrac", "actor/ppo_kl", "actor/tis_weight_mean", "actor/grad_norm",
                "rollout/logprob_abs_diff_max"):
        assert m_parts[key] == pytest.approx(m_full[key], rel=1e-4, abs=1e-7), key


def test_micro_batches_on_segments_count_each_trajectory_once(model):
    """Rows of a split trajectory may land in different micro-batches; the seq-mean weights
    still count the trajectory once."""
    pb, adv = _segmented_batch(model.config.vocab_size, 1)
    full, _ = _grads(model, pb, adv, loss_agg_mode="seq-mean-token-mean")
    parts, _ = _grads(model, pb, adv, loss_agg_mode="seq-mean-token-mean", ppo_micro_batch_size_per_gpu=2)
    _assert_same_grads(full, parts)


@pytest.mark.parametrize("seed", range(20))
def test_dynamic_micro_batches_cover_every_row_once_within_the_budget(seed):
    g = torch.Generator().manual_seed(seed)
    n = int(torch.randint(1, 40, (1,), generator=g))
    lengths = torch.randint(1, 300, (n + 5,), generator=g).tolist()
    rows = sorted(torch.randperm(n + 5, generator=g)[:n].tolist())
    budget = int(torch.randint(50, 1200, (1,), generator=g))
    parts = micro_batches(rows, lengths, max_tokens=budget)
    flat = [r for p in parts for r in p]
    assert sorted(flat) == rows, "every row exactly once"
    tokens = sum(lengths[r] for r in rows)
    assert sum(lengths[r] for p in parts for r in p) == tokens, "every token exactly once"
    for p in parts:
        cost = len(p) * max(lengths[r] for r in p)
        assert cost <= budget or len(p) == 1, (p, cost, budget)
    # fixed-size micro-batches keep the rows' order
    assert [r for p in micro_batches(rows, lengths, size=3) for r in p] == rows


def test_gradient_checkpointing_gives_the_same_gradients(model):
    from agentloop_trainer.policy import enable_gradient_checkpointing

    pb, adv = _batch(model.config.vocab_size)
    plain, m_plain = _grads(model, pb, adv)
    checkpointed = copy.deepcopy(model)
    enable_gradient_checkpointing(checkpointed)
    ckpt, m_ckpt = _grads(checkpointed, pb, adv, share_prefix_with_grad=False)
    _assert_same_grads(plain, ckpt, atol=1e-5)
    assert m_ckpt["actor/pg_loss"] == pytest.approx(m_plain["actor/pg_loss"], rel=1e-5)


def test_bfloat16_autocast_matches_float32_within_tolerance(model):
    """bf16 compute (fp32 master weights) on the tiny model: log-probs within 0.01 nats (measured
    0.0016 here, 0.0035 on the default tiny model), the loss within 1%, the gradient direction
    within cos > 0.999."""
    pb, adv = _batch(model.config.vocab_size)
    fp32 = PolicyGradientActor(model, ActorConfig(lr=0.0)).compute_log_probs(pb)
    bf16 = PolicyGradientActor(model, ActorConfig(lr=0.0, compute_dtype="bfloat16")).compute_log_probs(pb)
    mask = pb.response_mask.bool()
    gap = (fp32 - bf16)[mask].abs().max()
    assert 0 < gap < 0.01, "bf16 must differ (it ran) but stay close"
    g32, m32 = _grads(model, pb, adv)
    g16, m16 = _grads(model, pb, adv, compute_dtype="bfloat16")
    assert m16["actor/pg_loss"] == pytest.approx(m32["actor/pg_loss"], rel=0.01, abs=1e-5)
    flat32 = torch.cat([g.flatten() for g in g32.values()])
    flat16 = torch.cat([g16[n].flatten() for n in g32])
    assert flat16.dtype == torch.float32, "master gradients stay float32"
    cos = torch.nn.functional.cosine_similarity(flat32, flat16, dim=0)
    assert cos > 0.999, cos


def _lora(model, rank: int = 4):
    from agentloop_trainer.policy import apply_lora

    return apply_lora(copy.deepcopy(model), rank, 8, ["q_proj", "v_proj", "up_proj"])


def test_lora_trains_only_adapters_and_the_merged_push_reproduces_its_greedy_output(model, tokenizer):
    import asyncio

    from agentloop_engines.adapters.hf import HFServer
    from agentloop_trainer.update import iter_policy_weights

    policy = _lora(model)
    pb, adv = _batch(model.config.vocab_size)
    before = {n: p.detach().clone() for n, p in policy.named_parameters()}
    actor = PolicyGradientActor(policy, ActorConfig(lr=5e-2, tis_cap=None))
    assert {id(p) for g in actor.optimizer.param_groups for p in g["params"]} == {
        id(p) for n, p in policy.named_parameters() if "lora_" in n}
    for _ in range(3):
        actor.update(pb, adv)
    changed = {n for n, p in policy.named_parameters() if not torch.equal(p.detach(), before[n])}
    assert changed, sorted(changed)[:5]
    assert all("lora_" in n for n in changed), sorted(changed)[:5]
    assert any("lora_B" in n for n in changed), "B starts at zero: it must have moved for LoRA to matter"

    # Push the merged weights (in small buckets) into an engine holding the base model.
    engine = HFServer(copy.deepcopy(model), tokenizer, seed=0)
    buckets = list(iter_policy_weights(policy, bucket_bytes=64 * 1024))
    assert len(buckets) > 1
    assert all(not n.startswith("base_model") and ".base_layer." not in n
                                     for b in buckets for n, _ in b)
    prompt = pb.sequences[0][:24]

    async def go():
        for bucket in buckets:
            await engine.update_weights(bucket)
        return await engine.generate("r", prompt, {"temperature": 0.0, "max_tokens": 12})

    out = asyncio.run(go())
    policy.eval()
    with torch.no_grad():
        expected = policy.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False,
                                   eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    assert out.token_ids == expected[: len(out.token_ids)]
    assert len(out.token_ids) >= 1
    base_out = asyncio.run(HFServer(copy.deepcopy(model), tokenizer, seed=0).generate(
        "b", prompt, {"temperature": 0.0, "max_tokens": 12}))
    assert base_out.token_ids != out.token_ids, "the trained adapters must change the greedy output"


def test_lora_reference_is_the_base_model_with_adapters_disabled(model):
    policy = _lora(model)
    pb, adv = _batch(model.config.vocab_size)
    actor = PolicyGradientActor(policy, ActorConfig(lr=5e-2, tis_cap=None, use_kl_loss=True, kl_loss_coef=0.5))
    assert actor.ref_model is None
    assert actor.has_reference
    for _ in range(2):
        actor.update(pb, adv, ref_log_probs=actor.reference_log_probs(pb))
    ref = actor.reference_log_probs(pb)
    base = PolicyGradientActor(model, ActorConfig(lr=0.0)).compute_log_probs(pb)
    torch.testing.assert_close(ref, base, atol=1e-6, rtol=0)
    assert (actor.compute_log_probs(pb) - base).abs().max() > 1e-4, "the adapters moved the policy"


def test_lora_with_no_matching_module_names_the_modules(model):
    from agentloop_trainer.policy import apply_lora

    with pytest.raises(ValueError, match=r"matches no module.*q_proj"):
        apply_lora(copy.deepcopy(model), 4, 8, ["attention_dense"])


def _offload_rank(rank: int, model_path: str, offload: bool, dtype: str):
    from transformers import AutoModelForCausalLM

    from agentloop_trainer.update import policy_state_dict, shard_policy

    model = shard_policy(AutoModelForCausalLM.from_pretrained(model_path), "cpu", dtype, offload)
    pb, adv = _batch(model.config.vocab_size)
    actor = PolicyGradientActor(model, ActorConfig(lr=1e-2, tis_cap=None), device="cpu")
    losses = [actor.update(pb, adv)["actor/pg_loss"] for _ in range(2)]
    return losses, policy_state_dict(model)


@pytest.mark.slow
def test_one_rank_fsdp_with_offload_and_bf16_mixed_precision_train_like_one_process(model, random_model_path):
    """A one-rank FSDP2 group, as an offloaded single-process run uses: plain and offloaded
    give the same weights; bf16 mixed precision stays within tolerance of them."""
    from agentloop_trainer.update import spawn

    plain_losses, plain = spawn(_offload_rank, 1, str(random_model_path), False, "float32")
    off_losses, off = spawn(_offload_rank, 1, str(random_model_path), True, "float32")
    assert off_losses == pytest.approx(plain_losses, abs=1e-6)
    for name in plain:
        torch.testing.assert_close(off[name], plain[name], atol=1e-6, rtol=0, msg=name)
    bf_losses, bf = spawn(_offload_rank, 1, str(random_model_path), False, "bfloat16")
    assert bf_losses == pytest.approx(plain_losses, rel=0.05, abs=2e-3)
    moved = [(bf[n] - model.state_dict()[n]).abs().max() for n in plain]
    assert max(moved) > 1e-3, "the bf16 run trained"
    assert all(t.dtype == torch.float32 for t in bf.values()), "master weights stay float32"


DYNAMIC = {"use_dynamic_bsz": True, "ppo_max_token_len_per_gpu": 64, "loss_agg_mode": "seq-mean-token-mean"}
"""A budget that gives the two ranks different numbers of micro-batches (checked below)."""


def _dynamic_rank(rank: int, model_path: str):
    from transformers import AutoModelForCausalLM

    from agentloop_trainer.update import policy_state_dict, shard_policy

    model = shard_policy(AutoModelForCausalLM.from_pretrained(model_path))
    pb, adv = _batch(model.config.vocab_size)
    actor = PolicyGradientActor(model, ActorConfig(lr=1e-2, tis_cap=None, **DYNAMIC))
    lengths = [len(s) for s in pb.sequences]
    mine = len(micro_batches(actor.local_rows(range(8)), lengths, max_tokens=DYNAMIC["ppo_max_token_len_per_gpu"]))
    metrics = [actor.update(pb, adv) for _ in range(2)]
    return mine, [(m["actor/pg_loss"], m["actor/grad_norm"]) for m in metrics], policy_state_dict(model)


@pytest.mark.slow
def test_two_ranks_with_uneven_dynamic_micro_batches_match_one_process(model, random_model_path):
    from agentloop_trainer.update import spawn

    pb, adv = _batch(model.config.vocab_size)
    lengths = [len(s) for s in pb.sequences]
    budget = DYNAMIC["ppo_max_token_len_per_gpu"]
    counts = [len(micro_batches(range(4 * r, 4 * r + 4), lengths, max_tokens=budget)) for r in (0, 1)]
    assert counts[0] != counts[1], f"the ranks must need different numbers of passes, got {counts}"
    single = PolicyGradientActor(model, ActorConfig(lr=1e-2, tis_cap=None, loss_agg_mode=DYNAMIC["loss_agg_mode"]))
    expected = [(m["actor/pg_loss"], m["actor/grad_norm"]) for m in (single.update(pb, adv) for _ in range(2))]
    _, got, state = spawn(_dynamic_rank, 2, str(random_model_path))
    for (l1, g1), (l2, g2) in zip(expected, got, strict=True):
        assert l2 == pytest.approx(l1, abs=1e-5)
        assert g2 == pytest.approx(g1, rel=1e-4)
    expected_state = model.state_dict()
    assert state
    assert state.keys() <= expected_state.keys()
    for name, value in state.items():
        # One process runs the rows sharing a prompt once (prompt_shared_log_probs), so the
        # rounding differs from the ranks' padded passes; Adam scales it up to ~3e-5 here.
        torch.testing.assert_close(value, expected_state[name], atol=5e-5, rtol=0, msg=name)


def test_weight_buckets_are_bounded_and_hold_the_whole_model(model):
    from agentloop_trainer.update import iter_policy_weights, layer_group, tied_output_name

    budget = 100 * 1024
    buckets = list(iter_policy_weights(model, bucket_bytes=budget))
    assert len(buckets) > 2
    for b in buckets:  # a bucket closes at the first layer boundary once it reaches the budget
        last = layer_group(b[-1][0])
        assert sum(t.numel() * t.element_size() for n, t in b if layer_group(n) != last) < budget
    groups = [[layer_group(n) for n, _ in b] for b in buckets]
    for before, after in zip(groups, groups[1:], strict=False):
        assert before[-1] != after[0], f"decoder layer {after[0]} split across buckets (vLLM's fused reload needs it whole)"
    pushed = {n: t for b in buckets for n, t in b}
    assert pushed.keys() == model.state_dict().keys(), "engines get every weight, a tied head included"
    for name, value in pushed.items():
        assert torch.equal(value, model.state_dict()[name])
    assert model.config.tie_word_embeddings
    assert tied_output_name(model) == "lm_head.weight"
    for_folder = {n for b in iter_policy_weights(model, budget, include_tied=False) for n, _ in b}
    assert for_folder == pushed.keys() - {"lm_head.weight"}, "a Hugging Face folder stores a tied head once"
    with pytest.raises(ValueError, match="positive"):
        next(iter_policy_weights(model, bucket_bytes=0))


@pytest.mark.slow
def test_agentloop_train_with_every_memory_option(tmp_path, random_model_path):
    """`agentloop train` reaches each option from its config: LoRA with the KL to the adapter-
    disabled base, bf16, gradient checkpointing, token-budget micro-batches and a bucketed push."""
    import json

    from agentloop_trainer.cli import main

    reward = tmp_path / "parity.py"
    reward.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                      "    return float(len(solution_str) % 2)\n")
    args = [
        f"model.path={random_model_path}", "trainer.total_steps=2", f"trainer.run_dir={tmp_path / 'run'}",
        "trainer.test_freq=0", "trainer.save_freq=0", "trainer.progress_bar=false", "trainer.val_before_train=false",
        "data.train_size=16", "data.val_size=2", "data.train_batch_size=2", "actor_rollout_ref.rollout.n=3",
        "actor_rollout_ref.rollout.multi_turn.max_tokens_per_turn=12", "data.max_response_length=40",
        f"custom_reward_function.path={reward}", "actor_rollout_ref.actor.lr=5e-2",
        "actor_rollout_ref.model.lora_rank=4", "actor_rollout_ref.model.target_modules=[q_proj,v_proj]",
        "actor_rollout_ref.model.dtype=bfloat16", "actor_rollout_ref.model.enable_gradient_checkpointing=true",
        "actor_rollout_ref.actor.use_dynamic_bsz=true", "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=600",
        "actor_rollout_ref.actor.use_kl_loss=true", "actor_rollout_ref.rollout.update_weights_bucket_megabytes=0.1",
    ]
    assert main(["train", *args]) == 0
    steps = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [s for s in steps if "actor/pg_loss" in s]
    assert [s["step"] for s in steps] == [1, 2]
    assert all(s["actor/micro_batches"] > 1 for s in steps)
    assert all(s["perf/sync_buckets"] > 1 and 0 < s["perf/sync_bucket_peak_mb"] < 0.3 for s in steps)
    assert steps[0]["actor/kl_loss"] == pytest.approx(0.0, abs=1e-6), "adapters start at zero: policy == base"
    assert steps[1]["actor/kl_loss"] > 0, "after one update the adapters moved away from the base"


def _lora_rank(rank: int, model_path: str):
    from transformers import AutoModelForCausalLM

    from agentloop_trainer.policy import apply_lora
    from agentloop_trainer.update import policy_state_dict, shard_policy

    torch.manual_seed(0)
    model = apply_lora(AutoModelForCausalLM.from_pretrained(model_path), 4, 8, ["q_proj", "v_proj", "up_proj"])
    model = shard_policy(model)
    pb, adv = _batch(model.get_base_model().config.vocab_size)
    actor = PolicyGradientActor(model, ActorConfig(lr=5e-2, tis_cap=None, use_kl_loss=True, kl_loss_coef=0.5,
                                                   use_remove_padding=False))
    metrics = [actor.update(pb, adv, ref_log_probs=actor.reference_log_probs(pb)) for _ in range(2)]
    return [(m["actor/pg_loss"], m["actor/kl_loss"]) for m in metrics], policy_state_dict(model)


@pytest.mark.slow
def test_lora_on_two_fsdp_ranks_matches_one_process(model, random_model_path):
    """LoRA under FSDP2 (frozen base shards next to trained adapters), with the KL to the
    adapter-disabled base: the same losses and merged weights as one process."""
    from agentloop_trainer.update import policy_state_dict, spawn

    torch.manual_seed(0)
    policy = _lora(model)
    pb, adv = _batch(model.config.vocab_size)
    # Padded on both sides: one process would share the batch's repeated prompts where ranks
    # pack, and two Adam steps at lr 5e-2 carry that rounding to 2.01e-5 on one merged weight,
    # past this test's 2e-5 (packed FSDP against one process: test_packing_fsdp.py).
    actor = PolicyGradientActor(policy, ActorConfig(lr=5e-2, tis_cap=None, use_kl_loss=True, kl_loss_coef=0.5,
                                                    use_remove_padding=False))
    single = [actor.update(pb, adv, ref_log_probs=actor.reference_log_probs(pb)) for _ in range(2)]
    expected = policy_state_dict(policy)
    got, state = spawn(_lora_rank, 2, str(random_model_path))
    for m, (loss, kl) in zip(single, got, strict=True):
        assert loss == pytest.approx(m["actor/pg_loss"], abs=1e-5)
        assert kl == pytest.approx(m["actor/kl_loss"], abs=1e-6)
    assert single[1]["actor/kl_loss"] > 0
    assert state.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(state[name], expected[name], atol=2e-5, rtol=0, msg=name)


def test_the_update_lets_its_gradients_go_once_the_optimizer_has_stepped(model):
    """The rollout and the evaluation after an update need no gradients: held through them they
    cost a copy of the weights (0.54 GB on SmolLM2-135M) beside the engine's decode."""
    pb, adv = _batch(model.config.vocab_size)
    grads, _ = _grads(model, pb, adv)
    assert grads, "the update computed gradients"
    assert [n for n, p in model.named_parameters() if p.grad is not None] == []
