"""On-policy distillation (``distillation.*``, update/distill.py): the per-token reverse KL of a
teacher on the student's sampled tokens, against a hand computation on two small models; tool
tokens (mask 0) get no signal; a teacher with another vocab is refused; a 2-step run trains."""

from __future__ import annotations

import json
import math

import pytest
import torch

from agentloop_core.batch import RolloutBatch
from agentloop_core.output import AgentLoopOutput
from agentloop_trainer.config.errors import ConfigError
from agentloop_trainer.config.loading import load_config
from agentloop_trainer.policy import TinyModelConfig, build_tiny_policy
from agentloop_trainer.stages.teacher import build_distiller
from agentloop_trainer.update import ActorConfig, PolicyBatch, PolicyGradientActor, policy_batch_from_rollout
from agentloop_trainer.update.distill import (
    DISTILLATION_LOSSES,
    Distiller,
    TeacherVocabError,
    check_same_vocab,
    distill_advantages,
    kl_baseline,
    token_kl,
)
from agentloop_trainer.update.distill_settings import DistillationLossSection

SMALL = TinyModelConfig(hidden_size=32, num_attention_heads=4, intermediate_size=64)


def _loss(**keys):
    """``distillation.distillation_loss`` with k1 and no clamps or baseline, as the hand-computed
    expectations assume."""
    return DistillationLossSection(**{"loss_mode": "k1", "loss_max_clamp": None, "log_prob_min_clamp": None,
                                      "baseline": "none", **keys})


def _model(tokenizer, seed):
    return build_tiny_policy(tokenizer, seed=seed, spec=SMALL).eval()


def _hand_log_probs(model, sequence, prompt_length):
    """log p(token) of each response token of one sequence, straight from the logits."""
    with torch.no_grad():
        logits = model(torch.tensor([sequence])).logits[0].float()
    logp = torch.log_softmax(logits, -1)
    return [float(logp[t - 1, sequence[t]]) for t in range(prompt_length, len(sequence))]


def _multi_turn_batch():
    """Two trajectories; the first has a tool result (mask 0) between its two model turns."""
    outs = [AgentLoopOutput([1, 2, 3], [10, 11, 50, 51, 20, 21], [1, 1, 0, 0, 1, 1], reward_score=1.0,
                            trajectory_index=0),
            AgentLoopOutput([1, 2, 4], [12, 13, 14], [1, 1, 1], reward_score=0.0, trajectory_index=1)]
    return RolloutBatch.from_outputs(outs, pad_token_id=0)


def test_reverse_kl_per_token_matches_a_hand_computation(tokenizer):
    student, teacher = _model(tokenizer, 0), _model(tokenizer, 1)
    sequences = [[1, 2, 3, 10, 11, 12], [1, 2, 5, 13, 14]]
    prompts = [3, 3]
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    pb = PolicyBatch(sequences, prompts, mask, None)
    actor = PolicyGradientActor(student, ActorConfig())
    distiller = Distiller(teacher, _loss(distillation_loss_coef=0.5))

    old, advantages, metrics = distiller.apply(actor, pb, None, torch.zeros(2))

    expected = torch.zeros(2, 3)
    for b, (seq, p) in enumerate(zip(sequences, prompts, strict=True)):
        s, t = _hand_log_probs(student, seq, p), _hand_log_probs(teacher, seq, p)
        for j in range(len(seq) - p):
            expected[b, j] = s[j] - t[j]
    torch.testing.assert_close(advantages, -0.5 * expected, atol=1e-5, rtol=1e-5)
    assert metrics["distill/reverse_kl"] == pytest.approx(float(expected.sum() / 5), abs=1e-5)
    hand_teacher = [v for seq, p in zip(sequences, prompts, strict=True) for v in _hand_log_probs(teacher, seq, p)]
    assert metrics["distill/teacher_log_prob"] == pytest.approx(sum(hand_teacher) / 5, abs=1e-5)
    # The student's log-probs it computed are handed to the update as the old policy.
    assert float(old[0, 0]) == pytest.approx(_hand_log_probs(student, sequences[0], 3)[0], abs=1e-5)
    assert expected.abs().sum() > 0.1  # two differently seeded models do disagree


def test_a_teacher_equal_to_the_student_gives_exactly_zero(tokenizer):
    student = _model(tokenizer, 0)
    pb = policy_batch_from_rollout(_multi_turn_batch())
    _, advantages, metrics = Distiller(_model(tokenizer, 0), _loss()).apply(PolicyGradientActor(student, ActorConfig()),
                                                                           pb, None, torch.zeros(2))
    assert metrics["distill/reverse_kl"] == 0.0
    assert torch.count_nonzero(advantages) == 0


@pytest.mark.parametrize("use_task_rewards", [False, True])
def test_tool_tokens_get_no_signal_on_a_multi_turn_batch(tokenizer, use_task_rewards):
    student, teacher = _model(tokenizer, 0), _model(tokenizer, 1)
    pb = policy_batch_from_rollout(_multi_turn_batch())
    mask = pb.response_mask
    assert mask[0].tolist() == [1, 1, 0, 0, 1, 1]
    task = torch.tensor([0.25, -0.75])
    distiller = Distiller(teacher, _loss(use_task_rewards=use_task_rewards))
    _, advantages, _ = distiller.apply(PolicyGradientActor(student, ActorConfig()), pb, None, task)

    signal = advantages - (task[:, None] if use_task_rewards else 0.0)
    assert torch.count_nonzero(signal[mask == 0]) == 0
    assert bool((signal[mask == 1] != 0).all())  # every generated token, both turns, is scored
    # The tool tokens' log-probs differ between the two models: only the mask keeps them out.
    student_lp = PolicyGradientActor(student, ActorConfig()).compute_log_probs(pb)
    teacher_lp = PolicyGradientActor(student, ActorConfig()).compute_log_probs(pb, teacher)
    assert float((student_lp - teacher_lp)[0, 2:4].abs().min()) > 0


def test_kl_estimators_clamps_and_the_task_advantage():
    s = torch.tensor([[-0.5, -2.0, -30.0]])
    t = torch.tensor([[-1.0, -0.5, -1.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0]])
    torch.testing.assert_close(token_kl(s, t, mask, "k1"), torch.tensor([[0.5, -1.5, -29.0]]))
    k1 = s - t
    torch.testing.assert_close(token_kl(s, t, mask, "k3"), torch.exp(-k1) - 1 + k1)
    clamped = token_kl(s, t, mask, "k1", log_prob_min_clamp=-10.0, loss_max_clamp=5.0)
    torch.testing.assert_close(clamped, torch.tensor([[0.5, -1.5, -5.0]]))
    got = distill_advantages(torch.tensor([[1.0, 2.0]]), 0.5, torch.tensor([3.0]))
    torch.testing.assert_close(got, torch.tensor([[2.5, 2.0]]))
    per_turn = distill_advantages(torch.tensor([[1.0, 2.0]]), 1.0, torch.tensor([[0.5, -0.5]]))  # turn credit's [B, R]
    torch.testing.assert_close(per_turn, torch.tensor([[-0.5, -2.5]]))
    with pytest.raises(ValueError, match="valid: k1, k3"):
        token_kl(s, t, mask, "forward_kl_topk")
    assert DISTILLATION_LOSSES.names()[:2] == ["k1", "k3"]


def test_the_baseline_centres_the_signal_over_the_generated_tokens():
    """``mean``: each generated token's kl less the batch's mean over generated tokens (so the
    advantages no longer all share one sign); ``whiten``: also divided by their spread; masked
    positions stay 0 either way."""
    kl = torch.tensor([[0.5, 1.5, 9.0], [1.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])  # 9.0 sits on a tool token
    centred = kl_baseline(kl, mask, "mean")
    torch.testing.assert_close(centred, torch.tensor([[-0.5, 0.5, 0.0], [0.0, 0.0, 0.0]]))
    whitened = kl_baseline(kl, mask, "whiten")
    torch.testing.assert_close(whitened, torch.tensor([[-1.0, 1.0, 0.0], [0.0, 0.0, 0.0]]), atol=1e-4, rtol=1e-4)
    assert torch.equal(kl_baseline(kl, mask, "none"), kl)
    advantages = distill_advantages(centred, 2.0)
    assert float(advantages[mask == 1].sum()) == pytest.approx(0.0)
    assert (advantages[mask == 1] > 0).any()
    assert (advantages[mask == 1] < 0).any()
    with pytest.raises(ValueError, match=r"baseline must be one of \('mean', 'whiten', 'none'\), got 'median'"):
        kl_baseline(kl, mask, "median")


def test_the_configured_baseline_reaches_the_distiller(tokenizer):
    """``baseline`` defaults to verl's ``none``; ``baseline=mean`` from the config reaches the
    distiller: the advantages are the raw signal less its mean, and the logged reverse KL is
    still the raw mean."""
    student, teacher = _model(tokenizer, 0), _model(tokenizer, 1)
    pb = policy_batch_from_rollout(_multi_turn_batch())
    enabled = ["distillation.enabled=true", "distillation.teacher_model.model_path=/t"]
    raw_cfg = load_config(enabled)
    assert raw_cfg.distillation.distillation_loss.baseline == "none"
    cfg = load_config([*enabled, "distillation.distillation_loss.baseline=mean"])
    actor = PolicyGradientActor(student, ActorConfig())
    _, centred, metrics = Distiller.from_section(cfg.distillation, teacher).apply(actor, pb, None, torch.zeros(2))
    _, raw, raw_metrics = Distiller.from_section(raw_cfg.distillation, teacher).apply(actor, pb, None, torch.zeros(2))
    mask = pb.response_mask
    coef = cfg.distillation.distillation_loss.distillation_loss_coef
    torch.testing.assert_close(centred, (raw + coef * metrics["distill/reverse_kl"]) * mask, atol=1e-5, rtol=1e-5)
    assert metrics["distill/reverse_kl"] == raw_metrics["distill/reverse_kl"] != 0
    assert float(centred[mask == 1].mean()) == pytest.approx(0.0, abs=1e-6)
    assert float(raw[mask == 1].mean()) == pytest.approx(-coef * metrics["distill/reverse_kl"], abs=1e-6)
    with pytest.raises(ConfigError, match=r"distillation\.distillation_loss\.baseline must be one of"):
        load_config(["distillation.distillation_loss.baseline=median"])


def test_a_teacher_with_another_vocab_is_refused_naming_both_paths(tmp_path, tokenizer):
    from agentloop_core.testing import load_tiny_tokenizer

    other = load_tiny_tokenizer()
    other.add_tokens(["<not-in-the-student>"])
    teacher_dir = tmp_path / "teacher"
    build_tiny_policy(other, seed=0, spec=SMALL).save_pretrained(teacher_dir)
    other.save_pretrained(teacher_dir)
    cfg = load_config(["model.path=/students/tiny", "distillation.enabled=true",
                       f"distillation.teacher_model.model_path={teacher_dir}"])
    with pytest.raises(TeacherVocabError, match="different vocabularies") as err:
        build_distiller(cfg.distillation, cfg.model, tokenizer, "/students/tiny", sharded=False, device="cpu")
    assert str(teacher_dir) in str(err.value)
    assert "/students/tiny" in str(err.value)
    assert "<not-in-the-student>" in str(err.value)
    check_same_vocab(tokenizer, "/students/tiny", teacher_dir, teacher_tokenizer=load_tiny_tokenizer())  # same: fine


@pytest.mark.parametrize(("overrides", "match"), [
    (["distillation.enabled=true"], "distillation.teacher_model.model_path must be set"),
    (["distillation.distillation_loss.loss_mode=forward_kl_topk"], r"one of \('k1', 'k3'"),
    (["distillation.distillation_loss.use_policy_gradient=false"], "use_policy_gradient must be true"),
    (["distillation.distillation_loss.distillation_loss_coef=-1"], "distillation_loss_coef must be"),
])
def test_bad_distillation_settings_are_named(overrides, match):
    with pytest.raises(ConfigError, match=match):
        load_config(overrides)


def test_verl_spellings_are_read():
    notices: list[str] = []
    cfg = load_config(["distillation.teacher_models.teacher_model.model_path=/teachers/big",
                       "distillation.teacher_models.teacher_model.inference.name=vllm", "distillation.nnodes=1"],
                      notice=notices.append)
    assert cfg.distillation.teacher_model.model_path == "/teachers/big"
    assert len(notices) == 3


@pytest.mark.slow
def test_two_step_train_run_with_a_teacher(tmp_path, tokenizer, random_model_path):
    from agentloop_trainer.cli import main

    teacher_dir = tmp_path / "teacher"
    build_tiny_policy(tokenizer, seed=1, spec=TinyModelConfig(hidden_size=64, num_attention_heads=4, intermediate_size=128)).save_pretrained(
        teacher_dir)
    tokenizer.save_pretrained(teacher_dir)
    args = [f"model.path={random_model_path}", f"trainer.run_dir={tmp_path / 'run'}", "trainer.total_steps=2",
            "trainer.test_freq=0", "trainer.save_freq=0", "trainer.val_before_train=false", "trainer.progress_bar=false",
            "data.train_size=16", "data.val_size=2", "data.train_batch_size=2", "actor_rollout_ref.rollout.n=2",
            "actor_rollout_ref.rollout.multi_turn.max_tokens_per_turn=8", "data.max_response_length=24",
            "distillation.enabled=true", f"distillation.teacher_model.model_path={teacher_dir}",
            "distillation.distillation_loss.loss_max_clamp=null", "distillation.distillation_loss.log_prob_min_clamp=null",
            "distillation.distillation_loss.baseline=none"]
    assert main(["train", *args]) == 0
    steps = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [s for s in steps if "actor/pg_loss" in s]
    assert [s["step"] for s in steps] == [1, 2]
    for s in steps:
        assert math.isfinite(s["distill/reverse_kl"])
        assert s["distill/reverse_kl"] != 0
        assert s["distill/teacher_log_prob"] < 0
        # Pure distillation, one optimizer step, ratio 1: the token-mean loss is -mean(-kl).
        assert s["actor/pg_loss"] == pytest.approx(s["distill/reverse_kl"], rel=1e-4, abs=1e-5)
