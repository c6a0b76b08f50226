"""Partial rollout on Ray: a ``PartialRolloutServer`` hosted inside the shared client actor
(``client_actor(..., partial_rollout=True)``), driven through the ``RemoteClient`` proxy while
rollout workers in other processes generate through their own copies of that proxy.

The engine replicas here run :class:`HoldingEngine`, an engine whose output is a function of the
whole prefix and of its one "weight", and whose first call of a generation emits exactly ``HOLD``
tokens and then waits for its abort. So a weight update lands after exactly ``HOLD`` tokens
whatever the machine's load, and the test knows every token the generation must end with. The
real-model checks of a resumed generation's log-probs are ``test_partial_rollout_hf.py`` and
``test_partial_rollout_http.py``.

Debugging a failure: a generation that ended with other ids than :func:`expected_tokens` was
resumed from a wrong prefix (lost, repeated or re-encoded tokens) or on the wrong weights; a test
that hangs until ``HANG_S`` means a pause that never returned (a control call queued behind the
generate calls held at the gate, or an abort that never reached the engine).
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Iterable, Mapping
from typing import Any

import pytest
from partial_rollout_common import HANG_S

from agentloop_core.protocol import SamplingParams, ServerCapabilities, TokenOutput

ray = pytest.importorskip("ray", reason='Ray hosting tests need: pip install "agentloop-engines[ray]"')

from agentloop_engines.fleet.hosting import (  # noqa: E402
    client_actor,
    init_local_ray,
    start_replicas,
    stop_replicas,
)

pytestmark = [pytest.mark.ray]

FULL = 24
"""Tokens each generation asks for."""
HOLD = 7
"""Tokens a generation's first engine call emits before it waits for its abort."""


def next_token(prefix: list[int], weight: int) -> int:
    """The engine's next token: depends on every token before it and on the weights."""
    return 1 + (sum((i + 1) * t for i, t in enumerate(prefix)) + 37 * weight) % 250


def expected_tokens(prompt: list[int], switch_at: int, old: int, new: int) -> list[int]:
    """A FULL-token generation whose first ``switch_at`` tokens came from weight ``old`` and the
    rest, continuing from exactly those tokens, from weight ``new``."""
    prefix = list(prompt)
    for k in range(FULL):
        prefix.append(next_token(prefix, old if k < switch_at else new))
    return prefix[len(prompt):]


class HoldingEngine:
    """A token-by-token engine for partial rollout through Ray: see the module docstring.

    A call asking for all ``FULL`` tokens (a generation's first) emits ``HOLD`` and waits for
    ``abort``; any other call runs to its budget, stopping at a token boundary when aborted. An
    abort for a request that is not running is ignored, as a real engine's is. Each token's
    log-prob is ``-1 - weight``, so the log-probs show which weights sampled each token.
    """

    capabilities = ServerCapabilities(logprobs=True, weight_update=True)

    def __init__(self) -> None:
        self.weight = 0
        self._stop: dict[str, asyncio.Event] = {}

    async def generate(self, request_id: str, prompt_ids: list[int],
                       sampling_params: Mapping[str, Any] | SamplingParams | None = None) -> TokenOutput:
        sp = SamplingParams.from_mapping(sampling_params)
        stop = self._stop[request_id] = asyncio.Event()
        prefix, out = list(prompt_ids), []
        try:
            first = sp.max_tokens == FULL
            while len(out) < (HOLD if first else sp.max_tokens):
                if stop.is_set() and not first:
                    break
                out.append(next_token(prefix + out, self.weight))
                await asyncio.sleep(0)
            if first:
                await stop.wait()
        finally:
            del self._stop[request_id]
        aborted = len(out) < sp.max_tokens
        return TokenOutput(token_ids=out, log_probs=[-1.0 - self.weight] * len(out),
                           stop_reason="aborted" if aborted else "length")

    async def abort(self, request_id: str) -> None:
        if request_id in self._stop:
            self._stop[request_id].set()

    async def update_weights(self, named_tensors: Iterable[tuple[str, Any]]) -> None:
        self.weight = int(dict(named_tensors)["w"])

    async def sleep(self) -> None:
        return None

    async def wake_up(self) -> None:
        return None


@pytest.fixture(scope="module")
def ray_cluster(tmp_path_factory):
    init_local_ray(tmp_path_factory.mktemp("ray"))
    # HoldingEngine and the worker function travel by value: Ray workers cannot import this file.
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    yield
    ray.cloudpickle.unregister_pickle_by_value(sys.modules[__name__])
    ray.shutdown()


@pytest.fixture
def replicas(ray_cluster, request):
    handles = start_replicas(HoldingEngine, 2, num_cpus=0.1, name_prefix=f"pr-{request.node.name[:40]}")
    yield handles
    stop_replicas(handles)


def prompt_of(request_id: str) -> list[int]:
    return [11, 12, 13, 3 + sum(map(ord, request_id)) % 200]


@ray.remote(num_cpus=0.1)
def rollout_worker(proxy: Any, request_ids: list[str]) -> list[TokenOutput]:
    """A rollout worker in its own process, generating through its copy of the proxy."""
    async def run() -> list[TokenOutput]:
        params = {"max_tokens": FULL, "logprobs": True}
        return await asyncio.gather(*(proxy.generate(rid, prompt_of(rid), params) for rid in request_ids))
    return asyncio.run(run())


async def within(awaitable: Any, what: str) -> Any:
    """``await awaitable``, failing after ``HANG_S`` (``asyncio.wait_for`` would wait for the
    cancelled Ray call, which may never end: a call queued in the actor is not cancelled)."""
    future = asyncio.ensure_future(awaitable)
    done, _ = await asyncio.wait({future}, timeout=HANG_S)
    if not done:
        future.cancel()
        raise AssertionError(f"{what} did not return within {HANG_S} s")
    return future.result()


async def until_in_flight(proxy: Any, n: int) -> None:
    """Wait until ``n`` engine calls are in flight (asked in the control group: the generate
    slots may all be taken)."""
    deadline = time.monotonic() + HANG_S
    while (await within(proxy.rollout_state(), "rollout_state")).in_engine < n:
        assert time.monotonic() < deadline, f"{n} requests did not reach the engines within {HANG_S} s"
        await asyncio.sleep(0.05)


async def test_one_gate_for_every_worker_resumes_each_generation_from_its_kept_prefix(replicas):
    """Two workers (two processes) generate two requests each through copies of one proxy; the
    driver's pause aborts all four in the engines, the push reaches both replicas, and each
    generation resumes from its prompt plus exactly its ``HOLD`` tokens on the new weights. The
    ledger, read back through the proxy, gives each token's policy version."""
    proxy = client_actor(replicas, partial_rollout=True)
    try:
        ids = [[f"w{w}-{i}" for i in range(2)] for w in range(2)]
        flat = [rid for group in ids for rid in group]
        await proxy.set_policy_version(4)
        await proxy.track(flat)
        refs = [rollout_worker.remote(proxy, group) for group in ids]
        await until_in_flight(proxy, len(flat))

        await within(proxy.pause(), "pause")
        paused = await proxy.rollout_state()
        assert paused.paused, paused
        assert paused.stats["interrupted_calls"] == 4, paused
        await proxy.update_weights([("w", 1)])
        await proxy.unpause(5)
        outs = [o for part in await within(asyncio.gather(*refs), "the workers") for o in part]
        ledgers = await proxy.pop_ledger_many(flat)

        for rid, out, (tokens, versions) in zip(flat, outs, ledgers, strict=True):
            assert out.token_ids == expected_tokens(prompt_of(rid), HOLD, 0, 1), rid
            assert out.stop_reason == "length", rid
            assert out.extra["resumes"] == 1, rid
            assert out.log_probs == [-1.0] * HOLD + [-2.0] * (FULL - HOLD), rid
            assert out.extra["policy_versions"] == [4] * HOLD + [5] * (FULL - HOLD), rid
            assert (tokens, versions) == (out.token_ids, out.extra["policy_versions"]), rid
        state = await proxy.rollout_state()
        assert (state.policy_version, state.paused, state.ledger_size) == (5, False, 0), state
        assert state.stats == {"resumed_calls": 4, "interrupted_calls": 4, "updates": 1}
        assert (await proxy.get_stats())["in_flight"] == [0, 0]
    finally:
        ray.kill(proxy.actor)


async def test_control_calls_are_not_queued_behind_generates_held_at_the_gate(replicas):
    """With ``max_concurrency=2`` both generate slots are taken by calls that wait at the closed
    gate; pause, the push and unpause still run (their own concurrency group), and the calls
    resume."""
    proxy = client_actor(replicas, partial_rollout=True, max_concurrency=2)
    try:
        flat = ["a", "b"]
        await proxy.track(flat)
        ref = rollout_worker.remote(proxy, flat)
        await until_in_flight(proxy, 2)
        await within(proxy.pause(), "pause")
        await within(proxy.update_weights([("w", 3)]), "update_weights")
        await within(proxy.unpause(), "unpause")
        outs = await within(ref, "the worker")
        assert [o.token_ids for o in outs] == [expected_tokens(prompt_of(r), HOLD, 0, 3) for r in flat]
        assert [v for _, v in await proxy.pop_ledger_many(flat)] == [[0] * HOLD + [1] * (FULL - HOLD)] * 2
    finally:
        ray.kill(proxy.actor)


async def test_control_calls_without_partial_rollout_name_the_fix(replicas):
    proxy = client_actor(replicas)
    try:
        assert not proxy.partial_rollout
        with pytest.raises(RuntimeError, match=r"partial_rollout=True"):
            await proxy.pause()
    finally:
        ray.kill(proxy.actor)


@pytest.mark.parametrize("end", ["cancel", "timeout"])
async def test_an_ended_ray_batch_stops_its_generations_in_the_engines(replicas, end):
    """A Ray batch that ends early, because its caller cancels it (what the asynchronous trainer
    does to the groups still rolling out when it stops) or because it runs past
    ``ray_timeout_s``, cancels the workers' chunks, and through them (Ray cancels recursively)
    the engine calls they wait on.

    Every generation here holds in its engine until aborted, so before the end all four are in
    flight, and a chunk left running in its worker would keep its call there for good."""
    import agentloop_core.testing.loops  # noqa: F401  registers test_chat
    from agentloop_core.runtime import AgentLoopManager
    from agentloop_core.testing import tiny_tokenizer_path
    from agentloop_core.testing.loops import TEST_CHAT_AGENT

    proxy = client_actor(replicas, partial_rollout=True)
    config = {"default_agent_loop": TEST_CHAT_AGENT, "sampling_params": {"max_tokens": FULL},
              "prompt_length": 64, "response_length": FULL}
    manager = AgentLoopManager(proxy, str(tiny_tokenizer_path()), config, num_workers=2, backend="ray",
                               ray_num_cpus=0.1, ray_timeout_s=HANG_S)
    try:
        rows = [{"raw_prompt": [{"role": "user", "content": f"item {i}"}]} for i in range(4)]
        if end == "timeout":
            manager.ray_timeout_s = 2.0  # the workers have started: from here it limits the batch
        batch = asyncio.ensure_future(manager.agenerate_outputs(rows, step=0))
        await until_in_flight(proxy, 4)
        if end == "cancel":
            batch.cancel()
            with pytest.raises(asyncio.CancelledError):
                await batch
        else:
            with pytest.raises(TimeoutError, match="did not finish within ray_timeout_s=2.0"):
                await within(batch, "the timed-out batch")
        deadline = time.monotonic() + HANG_S
        while (state := await within(proxy.rollout_state(), "rollout_state")).in_engine:
            assert time.monotonic() < deadline, f"{state.in_engine} engine calls still run after the batch ended"
            await asyncio.sleep(0.05)
        assert (await proxy.get_stats())["in_flight"] == [0, 0]
    finally:
        manager.shutdown()
        ray.kill(proxy.actor)
