"""The prefix every row of a step shares runs once for all its micro-batches
(``update/step_prefix.py``), with the gradients of running it in each micro-batch: in the SFT
step and in the GRPO actor's update and log-prob passes.

The pairs: one SFT step in micro-batches against the same step as one pass (which runs the
prefix once by construction), in float32 (values) and under bfloat16 autocast (rounding only);
GRPO updates in micro-batches against the plain padded update; and the passes that start from
position 0, counted. A failure in the value pairs means the detached cache lost or doubled a
micro-batch's gradient.
"""

from __future__ import annotations

import pytest
import torch
from test_shared_prompt_forward import _group_batch

from agentloop_trainer.config import load_config
from agentloop_trainer.stages.sft import read_sft_files, write_sft_rows
from agentloop_trainer.stages.sft.loss import make_optimizer, sft_step, step_prefix
from agentloop_trainer.stages.sft.stage import sft_tokenizer
from agentloop_trainer.task import calculator_rows
from agentloop_trainer.update import MIN_SHARED_PREFIX, ActorConfig, PolicyGradientActor, response_log_probs
from agentloop_trainer.update.forward import common_prefix_length, sequence_log_probs


@pytest.fixture(scope="module")
def batch(tmp_path_factory, tokenizer):
    path = write_sft_rows(calculator_rows(8, seed=5), tmp_path_factory.mktemp("sft") / "demos.jsonl")
    sft = sft_tokenizer(load_config([]), tokenizer)
    return [sft.tokenize(e.messages, e.tools) for e in read_sft_files(path)]


def _model(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).train()


def _grads(model, batch, micro: int | None, dtype: str | None = None) -> tuple[float, dict[str, torch.Tensor]]:
    opt = make_optimizer(model, 0.0)  # lr 0: the step leaves the weights as they were
    out = sft_step(model, opt, batch, 0.0, micro_batch_size=micro, compute_dtype=dtype)
    return out["loss"], {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_the_batch_shares_a_prefix_that_scores_nothing(batch):
    ids = [e.input_ids for e in batch]
    first = min(e.loss_mask.index(1) for e in batch)
    assert common_prefix_length(ids) >= 16, "the calculator's system turn and tools are shared"
    assert first > 16


@pytest.mark.parametrize(("dtype", "rtol", "atol"), [(None, 1e-5, 1e-6), ("bfloat16", 2e-2, 2e-3)])
def test_micro_batches_on_one_prefix_give_the_one_pass_gradient(random_model_path, batch, dtype, rtol, atol):
    model = _model(random_model_path)
    loss_one, one = _grads(model, batch, None, dtype)
    loss_micro, micro = _grads(model, batch, 2, dtype)
    assert loss_micro == pytest.approx(loss_one, rel=rtol)
    assert one.keys() == micro.keys()
    assert len(one) == len(list(model.parameters()))
    for name, g in one.items():
        torch.testing.assert_close(micro[name], g, rtol=rtol, atol=atol, msg=lambda m, n=name: f"{n}: {m}")
    # The prefix's own weights get the gradient of every micro-batch (not the last one's only):
    # the embedding rows of the prefix's tokens carry it.
    emb = next(n for n in one if "embed" in n)
    prefix_token = batch[0].input_ids[1]
    assert one[emb][prefix_token].abs().sum() > 0


def test_the_prefix_runs_once_per_step_not_once_per_micro_batch(random_model_path, batch):
    model = _model(random_model_path)
    seen: list[int] = []
    hook = model.register_forward_pre_hook(lambda _m, args, kwargs: seen.append(kwargs["input_ids"].numel()),
                                           with_kwargs=True)
    try:
        _grads(model, batch, 2)
    finally:
        hook.remove()
    ids = [e.input_ids for e in batch]
    first = min(e.loss_mask.index(1) for e in batch)
    P = min(common_prefix_length(ids), first - 1)
    # One pass of the prefix, then each micro-batch's rows padded to their longest, from P on.
    tails = sum(len(chunk) * (max(len(i) for i in chunk) - P) for chunk in (ids[k : k + 2] for k in range(0, 8, 2)))
    assert seen == [P] + [2 * (max(len(i) for i in ids[k : k + 2]) - P) for k in range(0, 8, 2)]
    assert sum(seen) == P + tails


def test_a_step_prefix_refuses_rows_it_is_not_the_prefix_of(random_model_path, batch):
    model = _model(random_model_path)
    prefix = step_prefix(model, batch)
    assert prefix is not None
    other = [[7] + list(e.input_ids[1:]) for e in batch[:2]]
    with pytest.raises(ValueError, match="StepPrefix of .* needs rows that start with it"):
        sequence_log_probs(model, other, first_scored=prefix.length + 1, prefix=prefix)
    with pytest.raises(ValueError, match="score nothing inside it"):
        sequence_log_probs(model, [e.input_ids for e in batch[:2]], first_scored=2, prefix=prefix)


def test_no_step_prefix_where_none_is_worth_a_pass(random_model_path, batch):
    model = _model(random_model_path)
    short = batch[:2]
    # a conversation trained from its third token: the prefix before it is too short to share
    trained_early = type(batch[0])(input_ids=list(batch[0].input_ids), loss_mask=[0, 0] + [1] * (len(batch[0].input_ids) - 2))
    assert step_prefix(model, [trained_early, *short]) is None


def test_a_grpo_update_in_micro_batches_runs_the_prompts_prefix_once_with_the_padded_updates_weights(random_model_path):
    """The actor's micro-batches on one step prefix land on the weights of the plain padded
    update (no sharing at all), and the prefix every prompt shares goes through the model once
    per optimizer step (and once for the old log-probs), not once per micro-batch."""
    P = MIN_SHARED_PREFIX + 4
    results, prefix_passes = [], []
    for share in (True, False):
        model = _model(random_model_path)
        seen: list[bool] = []  # per forward call: whether it started from position 0 (no cache given)
        model.register_forward_pre_hook(
            lambda _m, _a, kw, seen=seen: seen.append(kw.get("cache", kw.get("past_key_values")) is None),
            with_kwargs=True)
        actor = PolicyGradientActor(model, ActorConfig(lr=1e-2, share_prefix_with_grad=share,
                                                       ppo_micro_batch_size_per_gpu=4, use_remove_padding=False))
        pb, adv = _group_batch(model.config.vocab_size, common_prefix=P)
        old = actor.compute_log_probs(pb)
        metrics = [actor.update(pb, adv, old) for _ in range(2)]
        results.append((old, metrics, {k: v.detach().clone() for k, v in model.state_dict().items()}))
        prefix_passes.append(sum(seen))
    (old_s, m_s, w_s), (_, m_p, w_p) = results
    # Sharing: the prefix once for the old log-probs and once per update; every other pass runs on
    # its cache. Plain: the old log-probs share (no gradient), each update micro-batch runs whole.
    # Before StepPrefix each micro-batch started from position 0: 4 + 2 x 4 calls in both.
    assert prefix_passes == [3, 1 + 2 * 4], "a micro-batch ran the shared prefix itself"
    assert m_s[0]["actor/micro_batches"] == 4
    with torch.no_grad():
        plain = response_log_probs(_model(random_model_path), pb, share_prefix=False)
    torch.testing.assert_close(old_s, plain, atol=2e-5, rtol=1e-5)
    for a, b in zip(m_s, m_p, strict=True):
        for key in ("actor/pg_loss", "actor/grad_norm"):
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), key
    for name, value in w_p.items():
        assert float((w_s[name] - value).abs().max()) < 1e-3, name


@pytest.mark.parametrize("window", [8, 512], ids=["window-inside-prefix", "window-past-it"])
def test_a_sliding_window_family_gets_the_one_pass_gradient_too(window):
    """Gemma 3's cache mixes sliding-window layers with full ones; a window shorter than the
    prefix crops what those layers keep. The step prefix must give the one-pass gradient both ways."""
    import random

    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    from agentloop_trainer.stages.sft.tokenize import TokenizedConversation

    torch.manual_seed(0)
    config = Gemma3TextConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=window,
                              max_position_embeddings=512)
    model = Gemma3ForCausalLM(config).float().train()
    rng = random.Random(0)
    common = [rng.randrange(3, 300) for _ in range(40)]
    batch = []
    for _ in range(8):
        q = [rng.randrange(3, 300) for _ in range(rng.randint(5, 9))]
        a = [rng.randrange(3, 300) for _ in range(rng.randint(10, 20))]
        batch.append(TokenizedConversation(common + q + a, [0] * (40 + len(q)) + [1] * len(a)))
    assert step_prefix(model, batch) is not None
    loss_one, one = _grads(model, batch, None)
    loss_micro, micro = _grads(model, batch, 2)
    assert loss_micro == pytest.approx(loss_one, rel=1e-5)
    for name, g in one.items():
        torch.testing.assert_close(micro[name], g, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
