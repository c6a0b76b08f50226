"""(c) The trainer recomputes the engine's log-probs: ``tool_agent`` trajectories rolled out by
HFServer (the trainer's ``RolloutFleet``, temperature 1, the built-in calculator task) scored
again with the trainer's forward (``agentloop_trainer.update.actor.response_log_probs``, the shared-prefix
path the GRPO update uses).

For SmolLM2 the policy is the checkpoint after the short tool-call fit, so trajectories have a
tool turn: generated tokens after a mask-0 tool response are scored at the right positions or
not at all. Gemma 3 270M (a base model the fit does not teach the format) runs raw, single-turn.
Measured on this machine: SmolLM2 max |trainer - engine| 2.2e-5 to 2.7e-5 over ~200-260
generated tokens in 6 trajectories, 4 with a tool turn; Gemma 3 7.5e-5 (mean 2.9e-5) over 288
tokens in 6 (float32; HFServer decodes with a KV cache in a left-padded batch, the trainer runs
one unpadded forward with a shared prefix). The bound, 1e-3, is ~10-40x that; an off-by-one
position scores another token, an error of nats, not 1e-5.
"""

from __future__ import annotations

import copy

import pytest
from real_model_helpers import report

torch = pytest.importorskip("torch", reason="the trainer needs torch")

BOUND = 1e-3


def has_tool_turn(mask_row: list[float]) -> bool:
    """Generated tokens, then mask-0 tokens (a tool response), then generated tokens again."""
    ones = [i for i, m in enumerate(mask_row) if m]
    return bool(ones) and any(not mask_row[i] for i in range(ones[0], ones[-1]))


@pytest.fixture
def policy(request, model_dir, real_model):
    """The checkpoint after the tool-call fit where the fit teaches tool calls (SmolLM2), else the
    raw checkpoint (Gemma 3: its rollouts are single turns)."""
    if real_model.learns_tool_calls_in_the_fit:
        return request.getfixturevalue("tool_fitted_model")
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()


def test_rollout_log_probs_match_the_trainer_forward(model_dir, real_model, tool_tokenizer, policy):
    from agentloop_trainer.config import load_config
    from agentloop_trainer.rollout import make_rows
    from agentloop_trainer.stages.rollout_setup import rollout_fleet
    from agentloop_trainer.task import dataset_row, make_problems
    from agentloop_trainer.update import policy_batch_from_rollout, response_log_probs

    cfg = load_config([
        f"model.path={model_dir}", f"model.custom_chat_template={real_model.tool_template}",
        "actor_rollout_ref.rollout.multi_turn.max_tokens_per_turn=48", "data.max_response_length=128",
        "actor_rollout_ref.rollout.temperature=1.0", "actor_rollout_ref.rollout.sanity_check=strict", "trainer.seed=3",
    ])
    engine = rollout_fleet(cfg, str(model_dir), tool_tokenizer, copy.deepcopy(policy))
    try:
        batch = engine.generate(make_rows([dataset_row(p, "test") for p in make_problems(3, 21)], 2))
    finally:
        engine.close()
    assert not any(batch.failed), "a trajectory failed; read its error in batch.extra_fields"
    pb = policy_batch_from_rollout(batch)
    mask = pb.response_mask.bool()
    with torch.no_grad():
        recomputed = response_log_probs(policy, pb)
    diff = (recomputed - pb.rollout_log_probs).abs()[mask]
    with_tool_turn = sum(has_tool_turn(row) for row in pb.response_mask.tolist())
    report(f"HFServer vs trainer forward: max |diff| {float(diff.max()):.2e}, mean {float(diff.mean()):.2e} over "
           f"{int(mask.sum())} generated tokens in {len(pb.sequences)} rows ({with_tool_turn} with a tool turn)")
    if real_model.learns_tool_calls_in_the_fit:
        assert with_tool_turn >= 1, "no trajectory made a tool call; the fit should have taught the format"
    assert float(diff.max()) < BOUND, f"max |trainer - engine| log-prob gap {float(diff.max())} (bound {BOUND})"
    assert torch.all(pb.rollout_log_probs[~mask] == 0), "tokens the engine did not generate carry no log-prob"
