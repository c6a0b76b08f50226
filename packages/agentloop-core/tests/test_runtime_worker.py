"""AgentLoopWorker: concurrency, order, sampling params, failures, timeouts, bad rows."""

from __future__ import annotations

import asyncio
import collections

import pytest

import agentloop_core.testing.loops  # noqa: F401  registers test_chat
from agentloop_core.loop import AgentLoopBase
from agentloop_core.output import AgentLoopOutput
from agentloop_core.registry import UnknownAgentLoopError, register
from agentloop_core.runtime import AgentLoopWorker, turn_slot
from agentloop_core.testing import ScriptedServer, load_tiny_tokenizer, tiny_tokenizer_path
from agentloop_core.testing.loops import TEST_CHAT_AGENT


@pytest.fixture(scope="module")
def tokenizer():
    return load_tiny_tokenizer()


def make_rows(n: int, **extra) -> list[dict]:
    return [
        {
            "agent_name": TEST_CHAT_AGENT,
            "raw_prompt": [{"role": "user", "content": f"question {i}"}],
            "index": i,
            **extra,
        }
        for i in range(n)
    ]


CONFIG = {
    "sampling_params": {"max_tokens": 6, "temperature": 1.0},
    "val_sampling_params": {"temperature": 0.0, "max_tokens": 3},
}


# Generous: a wait this long means a sample hung, never that the machine was slow.
HANG_S = 120


async def test_200_samples_run_concurrently_in_order(tokenizer):
    n = 200
    in_flight = peak = 0
    all_in_flight = asyncio.Event()

    class GatedServer(ScriptedServer):
        """Holds every generate until all samples are in flight: only concurrent samples pass."""

        async def generate(self, request_id, prompt_ids, sampling_params=None):
            nonlocal in_flight, peak
            in_flight += 1
            peak = max(peak, in_flight)
            if in_flight == n:
                all_in_flight.set()
            try:
                await all_in_flight.wait()
                return await super().generate(request_id, prompt_ids, sampling_params)
            finally:
                in_flight -= 1

    server = GatedServer(latency_s=0.05, eos_token_id=tokenizer.eos_token_id)
    worker = AgentLoopWorker(server, tokenizer, CONFIG)
    try:
        outputs = await asyncio.wait_for(worker.generate_sequences(make_rows(n)), HANG_S)
    except asyncio.TimeoutError:
        pytest.fail(f"samples did not all run at once: at most {peak} of {n} were in flight together")
    assert peak == n
    assert len(outputs) == n
    for i, out in enumerate(outputs):
        assert not out.failed, out.metrics
        assert f"question {i}" in tokenizer.decode(out.prompt_ids)
        assert out.metrics["agent_name"] == TEST_CHAT_AGENT
        assert out.metrics["generate_s"] >= 0.05
        assert out.metrics["agent_loop_s"] >= out.metrics["generate_s"]
    by_prompt = {tuple(c.prompt_ids): c.output.token_ids for c in server.calls}
    assert [by_prompt[tuple(o.prompt_ids)] for o in outputs] == [o.response_ids for o in outputs]


async def test_validate_uses_val_sampling_params(tokenizer):
    server = ScriptedServer()
    worker = AgentLoopWorker(server, tokenizer, CONFIG)
    await worker.generate_sequences(make_rows(3))
    assert {(c.sampling_params.temperature, c.sampling_params.max_tokens) for c in server.calls} == {(1.0, 6)}
    server.calls.clear()
    outputs = await worker.generate_sequences(make_rows(3), validate=True)
    assert {(c.sampling_params.temperature, c.sampling_params.max_tokens) for c in server.calls} == {(0.0, 3)}
    assert all(len(o.response_ids) == 3 for o in outputs)


async def test_raising_loop_yields_failed_sample_not_crash(tokenizer):
    rows = make_rows(6)
    rows[2]["fail"] = True
    rows[5]["fail"] = True
    outputs = await AgentLoopWorker(ScriptedServer(), tokenizer, CONFIG).generate_sequences(
        rows, sample_offset=10
    )
    assert [o.failed for o in outputs] == [False, False, True, False, False, True]
    assert "ScriptedLoopError" in outputs[2].metrics["error"]
    assert outputs[2].metrics["sample_index"] == 12
    assert outputs[2].response_ids == []
    assert outputs[0].response_ids


async def test_sample_timeout_fails_only_the_slow_sample(tokenizer):
    rows = make_rows(4)
    rows[1]["sleep_s"] = 10 * HANG_S  # only the sample timeout can end it
    worker = AgentLoopWorker(ScriptedServer(), tokenizer, {**CONFIG, "sample_timeout_s": 0.3})
    try:
        outputs = await asyncio.wait_for(worker.generate_sequences(rows), HANG_S)
    except asyncio.TimeoutError:
        pytest.fail("sample_timeout_s did not end the sleeping sample; the batch waited for it")
    assert [o.failed for o in outputs] == [False, True, False, False]
    assert "SampleTimeoutError" in outputs[1].metrics["error"]
    assert "sample_timeout_s=0.3" in outputs[1].metrics["error"]


async def test_max_concurrent_samples_caps_in_flight(tokenizer):
    in_flight = peak = 0

    class CountingServer(ScriptedServer):
        async def generate(self, request_id, prompt_ids, sampling_params):
            nonlocal in_flight, peak
            in_flight += 1
            peak = max(peak, in_flight)
            try:
                return await super().generate(request_id, prompt_ids, sampling_params)
            finally:
                in_flight -= 1

    worker = AgentLoopWorker(
        CountingServer(latency_s=0.01), tokenizer, {**CONFIG, "max_concurrent_samples": 4}
    )
    outputs = await worker.generate_sequences(make_rows(20))
    assert not any(o.failed for o in outputs)
    assert peak == 4


async def test_default_agent_loop_and_missing_name(tokenizer):
    rows = make_rows(3)
    del rows[1]["agent_name"]
    with pytest.raises(ValueError, match=r"row 1 has no 'agent_name'.*default_agent_loop"):
        await AgentLoopWorker(ScriptedServer(), tokenizer, CONFIG).generate_sequences(rows)
    worker = AgentLoopWorker(ScriptedServer(), tokenizer, {**CONFIG, "default_agent_loop": TEST_CHAT_AGENT})
    outputs = await worker.generate_sequences(rows)
    assert all(isinstance(o, AgentLoopOutput) and not o.failed for o in outputs)


async def test_unknown_agent_name_lists_known_names(tokenizer):
    rows = make_rows(2)
    rows[1]["agent_name"] = "no_such_loop"
    with pytest.raises(UnknownAgentLoopError, match=r"no_such_loop.*test_chat"):
        await AgentLoopWorker(ScriptedServer(), tokenizer, CONFIG).generate_sequences(rows)


def test_bad_sampling_params_name_the_config_key(tokenizer):
    # Checked once, when the config becomes a RolloutConfig, before any batch.
    with pytest.raises(
        ValueError, match=r"config sampling_params: unknown sampling parameter 'max_token'.*max_tokens"
    ):
        AgentLoopWorker(ScriptedServer(), tokenizer, {"sampling_params": {"max_token": 5}})


def test_bad_runtime_options_are_rejected(tokenizer):
    with pytest.raises(ValueError, match="sample_timeout_s"):
        AgentLoopWorker(ScriptedServer(), tokenizer, {"sample_timeout_s": -1})
    with pytest.raises(ValueError, match="max_concurrent_samples"):
        AgentLoopWorker(ScriptedServer(), tokenizer, {"max_concurrent_samples": 0})
    with pytest.raises(ValueError, match="turns_per_loop_iteration"):
        AgentLoopWorker(ScriptedServer(), tokenizer, {"turns_per_loop_iteration": 0})
    with pytest.raises(ImportError, match="no_such_module_xyz.*agent_loop_modules"):
        AgentLoopWorker(ScriptedServer(), tokenizer, {"agent_loop_modules": ["no_such_module_xyz"]})


async def test_tokenizer_path_is_loaded_lazily(tokenizer):
    worker = AgentLoopWorker(ScriptedServer(), str(tiny_tokenizer_path()), CONFIG)
    assert worker._tokenizer is None
    outputs = await worker.generate_sequences(make_rows(2))
    assert worker._tokenizer is not None
    assert outputs[1].prompt_ids == tokenizer.encode(
        tokenizer.apply_chat_template(
            make_rows(2)[1]["raw_prompt"], add_generation_prompt=True, tokenize=False
        ),
        add_special_tokens=False,
    )


async def test_a_worker_loading_its_tokenizer_from_a_path_sets_custom_chat_template(tokenizer):
    """Ray workers get the tokenizer as a path: the run's template must reach them with it."""
    from agentloop_core.tokenization import resolve_chat_template

    plain = ("{%- for m in messages %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}"
             "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
    worker = AgentLoopWorker(ScriptedServer(), str(tiny_tokenizer_path()), {**CONFIG, "custom_chat_template": plain})
    outputs = await worker.generate_sequences(make_rows(1))
    assert worker.tokenizer.chat_template == plain
    assert outputs[0].prompt_ids == tokenizer.encode(
        tokenizer.apply_chat_template(make_rows(1)[0]["raw_prompt"], chat_template=plain,
                                      add_generation_prompt=True, tokenize=False), add_special_tokens=False)
    named = AgentLoopWorker(ScriptedServer(), str(tiny_tokenizer_path()), {"custom_chat_template": "chatml-hermes"})
    assert named.tokenizer.chat_template == resolve_chat_template("chatml-hermes")


class RecordingReward:
    """A ``reward_fn``: scores the first generated token's parity x 10 and records the order."""

    def __init__(self, fail_index: int | None = None):
        self.order: list[int] = []
        self.fail_index = fail_index

    async def __call__(self, output, row, tokenizer):
        self.order.append(row["index"])
        if row["index"] == self.fail_index:
            raise ValueError("reward.py:compute_score returned 'yes'")
        output.metrics["reward/loop_said"] = output.reward_score
        output.reward_score = 10.0 * (output.response_ids[0] % 2)


async def test_reward_fn_scores_each_sample_as_it_finishes(tokenizer):
    server = ScriptedServer(eos_token_id=tokenizer.eos_token_id)
    reward = RecordingReward()
    worker = AgentLoopWorker(server, tokenizer, {**CONFIG, "reward_fn": reward})
    rows = make_rows(3)
    rows[0]["sleep_s"] = 0.3  # still running while the others are scored
    outputs = await worker.generate_sequences(rows)
    assert reward.order[-1] == 0
    assert sorted(reward.order) == [0, 1, 2]
    for out in outputs:
        assert out.reward_score == 10.0 * (out.response_ids[0] % 2)
        assert out.metrics["reward/loop_said"] in (0.0, 1.0)  # the loop's own reward was there to use
        assert out.metrics["reward_s"] >= 0


async def test_a_failing_reward_fn_fails_only_its_sample_with_the_error(tokenizer):
    server = ScriptedServer(eos_token_id=tokenizer.eos_token_id)
    worker = AgentLoopWorker(server, tokenizer, {**CONFIG, "reward_fn": RecordingReward(fail_index=1)})
    outputs = await worker.generate_sequences(make_rows(3))
    assert [o.failed for o in outputs] == [False, True, False]
    assert "compute_score returned 'yes'" in outputs[1].metrics["error"]


def test_reward_fn_must_be_callable(tokenizer):
    with pytest.raises(ValueError, match="reward_fn must be an async callable"):
        AgentLoopWorker(ScriptedServer(), tokenizer, {"reward_fn": "compute_score"})


async def test_loop_classes_by_import_path_and_per_loop_settings(tokenizer, tmp_path, monkeypatch):
    (tmp_path / "user_loops.py").write_text(
        "from agentloop_core.testing.loops import ChatTestLoop\n"
        "SEEN = []\n"
        "class MyLoop(ChatTestLoop):\n"
        "    async def run(self, sampling_params, **row):\n"
        "        SEEN.append(dict(self.config))\n"
        "        return await super().run(sampling_params, **row)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    config = {**CONFIG, "greeting": "common", "agent_loop_classes": {"my_loop": "user_loops:MyLoop"},
              "agent_loop_configs": {"my_loop": {"greeting": "mine"}}}
    worker = AgentLoopWorker(ScriptedServer(eos_token_id=tokenizer.eos_token_id), tokenizer, config)
    outputs = await worker.generate_sequences([{**make_rows(1)[0], "agent_name": "my_loop"}])
    assert not outputs[0].failed, outputs[0].metrics
    import user_loops

    assert user_loops.SEEN[0]["greeting"] == "mine"  # its own section wins over the common key
    assert worker.loop_config(TEST_CHAT_AGENT)["greeting"] == "common"  # other loops keep it


def test_a_loop_path_that_does_not_import_names_the_key(tokenizer):
    with pytest.raises(ValueError, match=r"agent_loop_classes\['x'\]: cannot import module 'nowhere.mod' for 'nowhere.mod:Loop'"):
        AgentLoopWorker(ScriptedServer(), tokenizer, {"agent_loop_classes": {"x": "nowhere.mod:Loop"}})
    with pytest.raises(ValueError, match="is not an AgentLoopBase subclass"):
        AgentLoopWorker(ScriptedServer(), tokenizer, {"agent_loop_classes": {"x": "json:dumps"}})


async def test_turn_pacer_lets_at_most_k_through_per_iteration_in_arrival_order():
    """Counted in event-loop iterations (a callback that re-schedules itself), not seconds."""
    from agentloop_core.runtime.pacing import TurnPacer

    pacer = TurnPacer(3)
    iteration = 0
    stop = False

    def tick() -> None:
        nonlocal iteration
        iteration += 1
        if not stop:
            asyncio.get_running_loop().call_soon(tick)

    asyncio.get_running_loop().call_soon(tick)
    released: list[tuple[int, int]] = []

    async def waiter(i: int) -> None:
        await pacer.wait()
        released.append((i, iteration))

    tasks = [asyncio.create_task(waiter(i)) for i in range(10)]
    tasks[5].cancel()  # a cancelled waiter takes no slot
    await asyncio.gather(*tasks, return_exceptions=True)
    stop = True
    order = [i for i, _ in released]
    assert order == [i for i in range(10) if i != 5], "first come, first served"
    per_iteration: dict[int, int] = {}
    for _, it in released:
        per_iteration[it] = per_iteration.get(it, 0) + 1
    assert max(per_iteration.values()) <= 3, per_iteration
    assert len(per_iteration) >= 3, per_iteration


async def test_paced_and_unpaced_workers_return_the_same_outputs(tokenizer):
    rows = make_rows(40)
    outputs = {}
    for pace in (1, None):
        server = ScriptedServer(latency_s=0.001, eos_token_id=tokenizer.eos_token_id)
        worker = AgentLoopWorker(server, tokenizer, {**CONFIG, "turns_per_loop_iteration": pace})
        outputs[pace] = await asyncio.wait_for(worker.generate_sequences(rows), HANG_S)
    assert [(o.prompt_ids, o.response_ids, o.response_mask) for o in outputs[1]] == [
        (o.prompt_ids, o.response_ids, o.response_mask) for o in outputs[None]]
    assert not any(o.failed for o in outputs[1])


async def test_paced_server_forwards_the_server_api():
    from agentloop_core.runtime.pacing import PacedServer, TurnPacer

    inner = ScriptedServer()
    paced = PacedServer(inner, TurnPacer(2))
    assert paced.capabilities == inner.capabilities
    assert paced.vocab_size == inner.vocab_size
    out = await paced.generate("r", [1, 2, 3], {"max_tokens": 4})
    assert out.token_ids
    assert inner.calls[-1].request_id == "r"
    await paced.abort("r")  # forwarded, not swallowed by __getattr__


class _Iterations:
    """Counts event-loop iterations: a callback that re-schedules itself."""

    def __init__(self) -> None:
        self.count = 0
        self.stopped = False
        asyncio.get_running_loop().call_soon(self._tick)

    def _tick(self) -> None:
        self.count += 1
        if not self.stopped:
            asyncio.get_running_loop().call_soon(self._tick)


@register("test_turn_slot")
class _WaitThenWorkLoop(AgentLoopBase):
    """Waits for a gate every sample shares (as tool calls that all end at once), then for its
    turn slot; records the iteration its work ran in."""

    async def run(self, sampling_params, **row):
        await row["gate"].wait()
        await turn_slot()
        row["ran_in"].append(row["clock"].count)
        return AgentLoopOutput(prompt_ids=[1], response_ids=[2], response_mask=[1])


@pytest.mark.parametrize("pace", [2, None])
async def test_turn_slot_paces_work_after_a_wait_that_ends_for_every_sample_at_once(tokenizer, pace):
    clock, gate, ran_in = _Iterations(), asyncio.Event(), []
    rows = [{"agent_name": "test_turn_slot", "gate": gate, "ran_in": ran_in, "clock": clock} for _ in range(12)]
    worker = AgentLoopWorker(ScriptedServer(), tokenizer, {"turns_per_loop_iteration": pace})
    batch = asyncio.create_task(worker.generate_sequences(rows))
    for _ in range(20):  # every sample starts (paced too) and waits at the gate
        await asyncio.sleep(0)
    gate.set()
    outputs = await asyncio.wait_for(batch, HANG_S)
    clock.stopped = True
    assert len(ran_in) == 12
    assert not any(o.failed for o in outputs)
    per_iteration = collections.Counter(ran_in)
    if pace is None:
        assert len(per_iteration) == 1, f"unpaced: every sample's work runs in one iteration, got {per_iteration}"
    else:
        assert max(per_iteration.values()) <= 2, per_iteration
        assert len(per_iteration) >= 6, per_iteration


async def test_turn_slot_outside_a_worker_returns_at_once():
    clock = _Iterations()
    await turn_slot()
    assert clock.count == 0, "no pacer: turn_slot must not wait for an iteration"
    clock.stopped = True


async def test_turn_slot_in_another_threads_event_loop_does_not_wait_for_this_ones_pacer():
    """A context copied into a thread that runs its own event loop (a sync tool doing
    asyncio.run) carries the pacer; turn_slot there must not touch this loop's pacer."""
    import contextvars

    from agentloop_core.runtime.pacing import TurnPacer, use_pacer

    use_pacer(TurnPacer(0))  # lets nobody through: any wait on it would hang or fail
    try:
        context = contextvars.copy_context()
        await asyncio.wait_for(asyncio.to_thread(context.run, asyncio.run, turn_slot()), HANG_S)
    finally:
        use_pacer(None)  # the test's context may be shared with later tests
