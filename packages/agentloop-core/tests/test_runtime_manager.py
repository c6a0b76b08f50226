"""AgentLoopManager: chunking, sync/async entry points, failure counts, in-process vs Ray."""

from __future__ import annotations

import shutil
import tempfile

import numpy as np
import pytest

import agentloop_core.testing.loops  # noqa: F401  registers test_chat
from agentloop_core.batch import RolloutBatch
from agentloop_core.runtime import AgentLoopManager, split_evenly
from agentloop_core.testing import ScriptedServer, load_tiny_tokenizer, tiny_tokenizer_path
from agentloop_core.testing.loops import TEST_CHAT_AGENT

CONFIG = {
    "default_agent_loop": TEST_CHAT_AGENT,
    "sampling_params": {"max_tokens": 5},
    "prompt_length": 32,
    "response_length": 16,
}


@pytest.fixture(scope="module")
def tokenizer():
    return load_tiny_tokenizer()


def make_rows(n: int) -> list[dict]:
    rows = [{"raw_prompt": [{"role": "user", "content": f"item {i}"}], "rollout_n": i % 2} for i in range(n)]
    for i in range(0, n, 4):
        rows[i]["observation"] = f"tool says {i}"  # two-turn samples, with mask-0 tokens
    return rows


def test_split_evenly():
    assert split_evenly(10, 3) == [(0, 4), (4, 7), (7, 10)]
    assert split_evenly(2, 4) == [(0, 1), (1, 2)]
    assert split_evenly(0, 2) == []


def test_manager_inprocess_chunks_keep_order_and_count_failures(tokenizer, caplog):
    rows = make_rows(10)
    rows[3]["fail"] = True
    rows[8]["fail"] = True
    manager = AgentLoopManager(ScriptedServer(), tokenizer, CONFIG, num_workers=3)
    batch = manager.generate_sequences(rows, step=1)
    manager.shutdown()
    assert isinstance(batch, RolloutBatch)
    assert len(batch) == 10
    np.testing.assert_array_equal(np.flatnonzero(batch.failed), [3, 8])
    assert batch.metrics["rollout/num_failed"] == 2
    assert batch.metrics["rollout/num_workers"] == 3
    assert "2 of 10 rollout samples failed" in caplog.text
    for i in range(10):
        if i in (3, 8):
            continue
        prompt = batch.prompts[i][batch.prompts[i] != batch.pad_token_id]
        assert f"item {i}" in tokenizer.decode(prompt)
    # Two-turn samples carry observation tokens with mask 0 inside the attention mask.
    assert batch.response_mask[0].sum() < batch.attention_mask[0, 32:].sum()
    assert batch.response_mask[1].sum() == batch.attention_mask[1, 32:].sum()
    assert "timing_s/agent_loop/generate/mean" in batch.metrics


async def test_async_entry_point_and_sync_inside_loop_error(tokenizer):
    manager = AgentLoopManager(ScriptedServer(), tokenizer, CONFIG, num_workers=2)
    batch = await manager.agenerate_sequences(make_rows(4), validate=True)
    assert len(batch) == 4
    assert batch.num_failed == 0
    with pytest.raises(RuntimeError, match="agenerate_sequences"):
        manager.generate_sequences(make_rows(1))


def test_manager_rejects_bad_arguments(tokenizer):
    with pytest.raises(ValueError, match="unknown rollout backend 'threads'.*inprocess, ray"):
        AgentLoopManager(ScriptedServer(), tokenizer, CONFIG, backend="threads")
    with pytest.raises(ValueError, match="num_workers"):
        AgentLoopManager(ScriptedServer(), tokenizer, CONFIG, num_workers=0)
    manager = AgentLoopManager(ScriptedServer(), tokenizer, {**CONFIG, "default_agent_loop": None})
    with pytest.raises(ValueError, match="row 0 has no 'agent_name'"):
        manager.generate_sequences(make_rows(2))
    manager.shutdown()


@pytest.mark.ray
@pytest.mark.slow  # ray.init and two actors importing transformers: 15-60 s on 2 shared cores
def test_ray_backend_matches_inprocess(tokenizer, tmp_path, monkeypatch):
    ray = pytest.importorskip("ray", reason='needs pip install "agentloop-core[ray]"')
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    monkeypatch.setenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    rows = make_rows(12)
    rows[5]["fail"] = True
    server = ScriptedServer(eos_token_id=tokenizer.eos_token_id)
    local = AgentLoopManager(server, tokenizer, CONFIG, num_workers=2).generate_sequences(rows, step=4)

    # Ray's socket paths must stay under 107 bytes, which pytest's tmp_path can exceed.
    ray_tmp = tempfile.mkdtemp(prefix="ray", dir="/tmp")
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        object_store_memory=256 * 2**20,
        _temp_dir=ray_tmp,
        runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}},
        log_to_driver=False,
    )
    try:
        spans = tmp_path / "spans.jsonl"
        with AgentLoopManager(
            ScriptedServer(eos_token_id=tokenizer.eos_token_id),
            str(tiny_tokenizer_path()),
            CONFIG,
            num_workers=2,
            backend="ray",
            tracer={"backend": "jsonl", "path": str(spans)},
            ray_num_cpus=0.25,
            ray_timeout_s=120,
        ) as remote_manager:
            remote = remote_manager.generate_sequences(rows, step=4)
    finally:
        ray.shutdown()
        shutil.rmtree(ray_tmp, ignore_errors=True)

    for name, array in local.arrays().items():
        np.testing.assert_array_equal(array, getattr(remote, name), err_msg=name)
    assert remote.metrics["rollout/num_failed"] == 1
    from agentloop_core.tracing.jsonl import read_spans

    roots = [s for s in read_spans(spans) if s["name"] == "agent_loop"]
    assert sorted(s["sample_index"] for s in roots) == list(range(12))
    assert all(s["step"] == 4 for s in roots)
