"""AgentLoopManager on Ray: worker placement facts and batches that survive a dead worker.

A worker dies here by ``ray.kill`` on a local Ray; tests/cluster removes whole nodes.
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile

import pytest

import agentloop_core.testing.loops  # noqa: F401  registers test_chat
from agentloop_core.runtime import AgentLoopManager
from agentloop_core.testing import ScriptedServer, load_tiny_tokenizer, tiny_tokenizer_path
from agentloop_core.testing.loops import TEST_CHAT_AGENT

ray = pytest.importorskip("ray", reason='needs pip install "agentloop-core[ray]"')

pytestmark = [pytest.mark.ray, pytest.mark.slow]  # ray.init + actors importing transformers: 20-60 s

CONFIG = {
    "default_agent_loop": TEST_CHAT_AGENT,
    "sampling_params": {"max_tokens": 4},
    "sampling_seed": 5,
    "prompt_length": 32,
    "response_length": 8,
}


@pytest.fixture(scope="module")
def local_ray():
    import os

    if ray.is_initialized():  # another module's session-wide Ray (e.g. tests/fault in one run)
        yield ray
        return
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    # Ray's socket paths must stay under 107 bytes, which pytest's tmp_path can exceed.
    tmp = tempfile.mkdtemp(prefix="ray", dir="/tmp")
    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=200 * 2**20, _temp_dir=tmp,
             runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}}, log_to_driver=False)
    yield ray
    ray.shutdown()
    shutil.rmtree(tmp, ignore_errors=True)


def make_rows(n: int) -> list[dict]:
    return [{"raw_prompt": [{"role": "user", "content": f"item {i}"}]} for i in range(n)]


def test_dead_worker_chunk_is_rerun_then_failed_when_none_is_left(local_ray):
    tokenizer = load_tiny_tokenizer()
    rows = make_rows(12)
    reference = AgentLoopManager(ScriptedServer(), tokenizer, CONFIG).generate_sequences(rows, step=1)
    manager = AgentLoopManager(
        ScriptedServer(latency_s=1.5), str(tiny_tokenizer_path()), CONFIG, num_workers=2, backend="ray",
        ray_num_cpus=0.25, ray_timeout_s=120, placement="spread",
    )
    try:
        node = ray.get_runtime_context().get_node_id()
        assert manager.worker_node_ids() == [node, node]  # one node: spread puts both there
        victim = manager._pool.workers[1]

        async def run_and_kill():
            task = asyncio.ensure_future(manager.agenerate_sequences(rows, step=1))
            await asyncio.sleep(0.7)  # both chunks are now waiting on the engine's latency
            ray.kill(victim.actor)
            return await task

        batch = asyncio.run(run_and_kill())
        assert len(batch) == 12
        assert batch.num_failed == 0
        assert batch.metrics["rollout/worker_failures"] == 1
        assert batch.metrics["rollout/num_retried"] == 6
        assert batch.metrics["rollout/num_workers"] == 1
        reruns = [m.get("rerun_after", "") for m in batch.sample_metrics]
        assert all("rollout worker 1" in r and "died" in r for r in reruns[6:])
        assert not any(reruns[:6])
        # Per-trajectory seeds: the re-run samples equal what the first worker would have made.
        assert batch.responses.tolist() == reference.responses.tolist()
        assert manager.worker_node_ids() == [node]

        ray.kill(manager._pool.workers[0].actor)
        lost = manager.generate_sequences(rows[:4], step=2)
        assert lost.num_failed == 4
        errors = [m["error"] for m in lost.sample_metrics]
        assert all("rollout worker 0" in e and "no rollout worker is left" in e for e in errors), errors
        assert lost.metrics["rollout/worker_failures"] == 1
        assert lost.metrics["rollout/num_lost_to_worker_failures"] == 4
        again = manager.generate_sequences(rows[:2], step=3)
        assert again.num_failed == 2
        assert "all 2 rollout workers died" in again.sample_metrics[0]["error"]
    finally:
        manager.shutdown()


def test_default_placement_and_bad_placement(local_ray):
    with pytest.raises(ValueError, match="unknown worker placement 'everywhere'; valid: spread, default"):
        AgentLoopManager(ScriptedServer(), "unused", CONFIG, backend="ray", placement="everywhere")
    with AgentLoopManager(ScriptedServer(), str(tiny_tokenizer_path()), CONFIG, num_workers=1, backend="ray",
                          ray_num_cpus=0.25, ray_timeout_s=120, placement="default") as manager:
        assert manager.worker_node_ids() == [ray.get_runtime_context().get_node_id()]
        assert manager.generate_sequences(make_rows(2), step=0).num_failed == 0
    assert AgentLoopManager(ScriptedServer(), "unused", CONFIG).worker_node_ids() == [None]
