"""Synchronous agents must not starve the engine (issue #31, class 1).

``http_agent`` used to run a synchronous agent with ``asyncio.to_thread`` while HFServer ran its
prefill and decode through the same default thread pool: with as many concurrent samples as that
pool has threads, every thread waited on a gateway call only the engine could answer, and the
engine's work waited for a thread. The rollout hung for good.

Here the event loop's default executor is given fewer threads than there are samples (the
deadlock then happens whatever the host's CPU count), the agent is the README's plain
``openai.OpenAI`` agent, and the engine is the real HFServer on the tiny model behind the real
gateway. The whole rollout is bounded, so the old code's hang fails the test instead of hanging it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from typing import Any

import pytest

openai = pytest.importorskip("openai", reason='http_agent tests need the openai client: pip install "agentloop-engines[test]"')
pytest.importorskip("fastapi", reason='HTTP tests need: pip install "agentloop-engines[server]"')
pytest.importorskip("torch", reason='HFServer needs pip install "agentloop-engines[hf]"')
pytest.importorskip("transformers", reason='HFServer needs pip install "agentloop-engines[hf]"')

from agentloop_core.runtime import AgentLoopWorker  # noqa: E402
from agentloop_engines.adapters.hf import HFServer  # noqa: E402
from agentloop_engines.serving.http_agent import SyncAgentPoolFullError, close_gateways, sync_agent_pool  # noqa: E402
from agentloop_engines.testing.tiny_model import build_tiny_model  # noqa: E402

DEFAULT_POOL_THREADS = 3
SAMPLES = 8
SAMPLING = {"temperature": 1.0, "max_tokens": 6}
CLIENT_TIMEOUT_S = 10.0
"""An agent call that is never served gives up after this (so the old code's threads come back)."""
ROLLOUT_BOUND_S = 60.0


def readme_agent(base_url: str, row: dict) -> dict:
    """The README's synchronous agent: two plain ``openai.OpenAI`` calls."""
    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=CLIENT_TIMEOUT_S)
    messages = list(row["raw_prompt"])
    for _ in range(2):
        reply = client.chat.completions.create(model="any", messages=messages)
        messages += [{"role": "assistant", "content": reply.choices[0].message.content or ""},
                     {"role": "user", "content": "And then?"}]
    return {"reward": 1.0}


async def rollout(tokenizer: Any, **loop_config: Any) -> list[Any]:
    """``SAMPLES`` rows of the README agent through ``http_agent`` on HFServer (tiny model),
    bounded by ``ROLLOUT_BOUND_S`` so that a starved engine fails the test instead of hanging it."""
    engine = HFServer(build_tiny_model(), max_model_len=512)
    worker = AgentLoopWorker(engine, tokenizer, {"agent_loop_configs": {"http_agent": {"agent": readme_agent,
                                                                                       **loop_config}},
                                                 "sampling_params": SAMPLING})
    rows = [{"index": i, "agent_name": "http_agent",
             "raw_prompt": [{"role": "user", "content": f"Count to {i}."}]} for i in range(SAMPLES)]
    try:
        return await asyncio.wait_for(worker.generate_sequences(rows), ROLLOUT_BOUND_S)
    finally:
        await engine.close()


@pytest.fixture(autouse=True)
def _stop_gateways():
    yield
    close_gateways()


async def test_more_sync_agents_than_default_threads_complete_against_hfserver(tokenizer):
    loop = asyncio.get_running_loop()
    small = concurrent.futures.ThreadPoolExecutor(max_workers=DEFAULT_POOL_THREADS, thread_name_prefix="default")
    loop.set_default_executor(small)
    outputs = await rollout(tokenizer, timeout_s=45)
    errors = [o.metrics.get("error") for o in outputs if o.failed]
    assert not errors, f"{len(errors)} of {SAMPLES} samples failed: {errors[:2]}"
    assert len({o.trajectory_index for o in outputs}) == SAMPLES
    assert all(o.metrics["http_calls"] == 2 and o.reward_score == 1.0 for o in outputs)


async def test_a_pool_smaller_than_the_samples_queues_them(tokenizer):
    """With a pool of 2 threads and 8 samples, samples wait for a thread and all complete."""
    outputs = await rollout(tokenizer, max_sync_agent_threads=2)
    assert not [o for o in outputs if o.failed], [o.metrics.get("error") for o in outputs if o.failed]
    assert sync_agent_pool(2).stats["started"] == 2


async def test_a_pool_whose_threads_are_all_stuck_refuses_at_once():
    """Agents that ran past their timeout and never return hold their threads; the next sample
    is refused naming the setting instead of waiting forever."""
    import threading

    release = threading.Event()
    pool = sync_agent_pool(1)
    with pytest.raises(TimeoutError, match="timeout_s"):
        await pool.run(release.wait, 30.0, timeout_s=0.2)
    try:
        with pytest.raises(SyncAgentPoolFullError, match="max_sync_agent_threads"):
            await pool.run(lambda: None, timeout_s=5.0)
    finally:
        release.set()
