"""PartialRolloutServer in front of a scripted engine (core alone, no model).

The scripted engine here streams its reply one token per event-loop turn and honours ``abort``
at a token boundary, returning the tokens so far with ``stop_reason="aborted"``, as every
agentloop engine does; the real-model version of these checks (log-probs of the resumed tokens
under the new weights) is ``agentloop-engines/tests/test_partial_rollout_hf.py``.

Debugging a failure: ``engine.calls`` holds every engine call with the exact prompt ids it got,
so a resume that re-encoded, lost or duplicated tokens shows there as a prompt that is not
``PROMPT + tokens so far``.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any

import pytest

from agentloop_core.partial_rollout import (
    LocalRolloutControl,
    PartialRolloutServer,
    PartialRolloutState,
    RolloutControl,
    resume_seed,
)
from agentloop_core.protocol import SamplingParams, TokenOutput
from agentloop_core.testing import ScriptedServer

PROMPT = [11, 12, 13]
HANG_S = 30  # a wait this long means a hang, never a slow machine


def _reply(request_id: str, prompt_ids: list[int], call_index: int) -> list[int]:
    # Each token depends on the whole prefix before it, so a resume from a wrong prefix (lost,
    # repeated or re-encoded tokens) produces different ids than the uninterrupted reply.
    ids, prefix = [], list(prompt_ids)
    for _ in range(64):
        tok = 1 + (sum((i + 1) * t for i, t in enumerate(prefix)) % 250)
        ids.append(tok)
        prefix.append(tok)
    return ids


class StreamingScriptedServer(ScriptedServer):
    """A :class:`ScriptedServer` that emits its reply one token per event-loop turn and stops
    at a token boundary when aborted (an abort for a request not running is ignored); weight
    pushes are recorded in ``pushes`` with the requests running at the time."""

    def __init__(self) -> None:
        super().__init__(_reply)
        self.running: dict[str, int] = {}
        """Tokens emitted so far by each running request."""
        self._abort_now: set[str] = set()
        self.aborts: list[str] = []
        self.pushes: list[tuple[dict[str, Any], set[str]]] = []

    async def generate(self, request_id: str, prompt_ids: list[int],
                       sampling_params: Mapping[str, Any] | SamplingParams | None = None) -> TokenOutput:
        full = await super().generate(request_id, prompt_ids, sampling_params)
        out: list[int] = []
        self.running[request_id] = 0
        try:
            for tok in full.token_ids:
                await asyncio.sleep(0)
                if request_id in self._abort_now:
                    break
                out.append(tok)
                self.running[request_id] = len(out)
        finally:
            del self.running[request_id]
            self._abort_now.discard(request_id)
        aborted = len(out) < len(full.token_ids)
        log_probs = full.log_probs[: len(out)] if full.log_probs is not None else None
        return TokenOutput(token_ids=out, log_probs=log_probs, stop_reason="aborted" if aborted else full.stop_reason)

    async def abort(self, request_id: str) -> None:
        self.aborts.append(request_id)
        if request_id in self.running:
            self._abort_now.add(request_id)

    async def update_weights(self, named_tensors: Iterable[tuple[str, Any]]) -> None:
        self.pushes.append((dict(named_tensors), set(self.running)))


async def _until(predicate, what: str) -> None:
    async def wait() -> None:
        # Any predicate over the engine's state, which changes once per event-loop turn: checking
        # it every turn is what lets a test act at an exact token boundary.
        while not predicate():  # noqa: ASYNC110 - see above
            await asyncio.sleep(0)

    try:
        await asyncio.wait_for(wait(), HANG_S)
    except asyncio.TimeoutError:
        raise AssertionError(f"timed out waiting for {what}") from None


def _run(coro):
    return asyncio.run(asyncio.wait_for(coro, HANG_S))


PARAMS = {"max_tokens": 20, "logprobs": True, "seed": 7}


def test_interrupted_generation_resumes_from_exactly_its_ids():
    async def main():
        engine = StreamingScriptedServer()
        wrapper = PartialRolloutServer(engine, keep_ledger=True)
        task = asyncio.create_task(wrapper.generate("traj-0", list(PROMPT), PARAMS))
        await _until(lambda: engine.running.get("traj-0", 0) >= 5, "5 tokens before the update")
        async with wrapper.weight_update():
            assert "traj-0" not in engine.running, "no engine call spans a weight update"
        return engine, wrapper, await task

    engine, wrapper, out = _run(main())
    first, second = engine.calls
    k = PARAMS["max_tokens"] - second.sampling_params.max_tokens
    assert first.prompt_ids == PROMPT
    assert first.sampling_params.max_tokens == PARAMS["max_tokens"]
    assert 5 <= k < PARAMS["max_tokens"], "the update cut the generation between its 5th and last token"
    assert second.prompt_ids == PROMPT + out.token_ids[:k], "resumed from the prompt plus exactly the ids so far"
    # The same reply an uninterrupted generation gives: nothing lost, repeated or re-encoded.
    assert out.token_ids == _reply("", PROMPT, 0)[: PARAMS["max_tokens"]]
    assert out.stop_reason == "length"
    assert len(out.log_probs) == len(out.token_ids)
    assert out.extra["policy_versions"] == [0] * k + [1] * (PARAMS["max_tokens"] - k)
    assert out.extra["resumes"] == 1
    assert wrapper.stats["interrupted_calls"] == 1
    assert second.sampling_params.seed == resume_seed(PARAMS["seed"], k) != PARAMS["seed"]
    assert wrapper.pop_ledger("traj-0") == (out.token_ids, out.extra["policy_versions"])
    assert wrapper.ledger_size == 0


def test_budget_is_the_rest_of_max_tokens_across_several_updates():
    async def main():
        engine = StreamingScriptedServer()
        wrapper = PartialRolloutServer(engine)
        task = asyncio.create_task(wrapper.generate("traj-0", list(PROMPT), PARAMS))
        for at_least in (3, 3):
            await _until(lambda n=at_least: engine.running.get("traj-0", 0) >= n, "tokens before an update")
            async with wrapper.weight_update():
                pass
        return engine, wrapper, await task

    engine, wrapper, out = _run(main())
    assert len(engine.calls) == 3
    assert out.extra["resumes"] == 2
    budgets = [c.sampling_params.max_tokens for c in engine.calls]
    assert budgets[0] == PARAMS["max_tokens"]
    assert budgets == sorted(budgets, reverse=True)
    for call in engine.calls:
        done = PARAMS["max_tokens"] - call.sampling_params.max_tokens
        assert call.prompt_ids == PROMPT + out.token_ids[:done], "each resume asks for exactly the tokens left"
    assert len(out.token_ids) == PARAMS["max_tokens"]
    versions = out.extra["policy_versions"]
    assert versions == sorted(versions)
    assert set(versions) == {0, 1, 2}
    assert wrapper.policy_version == 2


def test_caller_abort_is_not_resumed():
    async def main():
        engine = StreamingScriptedServer()
        wrapper = PartialRolloutServer(engine)
        task = asyncio.create_task(wrapper.generate("traj-0", list(PROMPT), PARAMS))
        await _until(lambda: engine.running.get("traj-0", 0) >= 2, "tokens before the abort")
        await wrapper.abort("traj-0")
        out = await task
        return engine, out

    engine, out = _run(main())
    assert out.stop_reason == "aborted"
    assert len(engine.calls) == 1
    assert out.extra["resumes"] == 0
    assert 2 <= len(out.token_ids) < PARAMS["max_tokens"]


def test_caller_abort_during_a_weight_update_is_not_resumed():
    """The update interrupted the call; the caller aborts while it waits at the gate (the
    engine ignores that abort, nothing of it runs there): it must end, not resume."""
    async def main():
        engine = StreamingScriptedServer()
        wrapper = PartialRolloutServer(engine)
        task = asyncio.create_task(wrapper.generate("traj-0", list(PROMPT), PARAMS))
        await _until(lambda: engine.running.get("traj-0", 0) >= 2, "tokens before the update")
        async with wrapper.weight_update():
            await wrapper.abort("traj-0")
        return engine, await task

    engine, out = _run(main())
    assert out.stop_reason == "aborted", "an aborted generation never resumes"
    assert len(engine.calls) == 1, "an aborted generation never resumes"
    assert out.extra["policy_versions"] == [0] * len(out.token_ids)


def test_one_step_off_waits_for_in_flight_calls_on_the_old_weights():
    async def main():
        engine = StreamingScriptedServer()
        wrapper = PartialRolloutServer(engine, interrupt=False)
        task = asyncio.create_task(wrapper.generate("traj-0", list(PROMPT), PARAMS))
        await _until(lambda: engine.running.get("traj-0", 0) >= 2, "tokens before the update")
        pausing = asyncio.create_task(wrapper.pause())
        await _until(lambda: wrapper.paused, "the gate to close")
        later = asyncio.create_task(wrapper.generate("traj-1", list(PROMPT), PARAMS))
        await pausing
        assert task.done(), "the pause returns only once the in-flight call finished"
        assert "traj-1" not in engine.running, "no call starts while paused"
        wrapper.unpause()
        return engine, await task, await later

    engine, out, later = _run(main())
    assert engine.aborts == [], "one_step_off never aborts"
    assert out.stop_reason == "length"
    assert len(out.token_ids) == PARAMS["max_tokens"]
    assert out.extra["policy_versions"] == [0] * PARAMS["max_tokens"]
    assert out.extra["resumes"] == 0
    assert later.extra["policy_versions"] == [1] * PARAMS["max_tokens"], "started after the update"


def test_ledger_keeps_only_tracked_request_ids():
    """Evaluation requests go through the same wrapper and are never popped: they must leave
    nothing in the ledger."""
    async def main():
        wrapper = PartialRolloutServer(StreamingScriptedServer())
        wrapper.track(["train-0-0-0"])
        await asyncio.gather(wrapper.generate("train-0-0-0", list(PROMPT), PARAMS),
                             wrapper.generate("eval-0-0-0", list(PROMPT), PARAMS))
        return wrapper

    wrapper = _run(main())
    assert wrapper.ledger_size == 1
    ids, versions = wrapper.pop_ledger("train-0-0-0")
    assert len(ids) == len(versions) == PARAMS["max_tokens"]
    assert wrapper.ledger_size == 0, "an untracked (evaluation) request left an entry behind"
    with pytest.raises(RuntimeError, match="call track"):
        wrapper.pop_ledger("eval-0-0-0")


def test_pause_and_unpause_misuse_name_the_fix():
    async def main():
        wrapper = PartialRolloutServer(StreamingScriptedServer())
        with pytest.raises(RuntimeError, match="call pause"):
            wrapper.unpause()
        await wrapper.pause()
        with pytest.raises(RuntimeError, match="call unpause"):
            await wrapper.pause()
        wrapper.unpause(policy_version=5)
        return wrapper

    assert _run(main()).policy_version == 5


def _prompt_of(request_id: str) -> list[int]:
    # A prompt per id, so each id's reply (and so its ledger entry) differs from the others'.
    return PROMPT + [1 + sum(map(ord, request_id)) % 200]


def test_pop_ledger_many_pops_every_id_in_order_then_raises_for_the_first_untracked():
    """A group's rows are popped in one call: one untracked id among them must not leave the
    tracked ones behind (they would leak until the run ends), and the error names that id."""
    async def main():
        wrapper = PartialRolloutServer(StreamingScriptedServer())
        wrapper.track(["a", "c"])
        outs = await asyncio.gather(*(wrapper.generate(rid, _prompt_of(rid), PARAMS) for rid in "abcd"))
        return wrapper, dict(zip("abcd", outs, strict=True))

    wrapper, outs = _run(main())
    assert wrapper.ledger_size == 2
    with pytest.raises(RuntimeError, match="request 'b' was not tracked"):
        wrapper.pop_ledger_many(["c", "b", "a", "d"])
    assert wrapper.ledger_size == 0, "the tracked ids after the untracked one must still be popped"
    with pytest.raises(RuntimeError, match="call track"):
        wrapper.pop_ledger("a")  # popped above: no longer tracked

    wrapper.track(["a", "c"])
    assert wrapper.pop_ledger_many(["c", "a"]) == [([], []), ([], [])], "tracked ids that generated nothing"

    async def again():
        wrapper.track(["a", "c"])
        await asyncio.gather(*(wrapper.generate(rid, _prompt_of(rid), PARAMS) for rid in "ac"))

    _run(again())
    popped = wrapper.pop_ledger_many(["c", "a"])
    assert popped == [(outs[rid].token_ids, outs[rid].extra["policy_versions"]) for rid in "ca"], \
        "one entry per id, in the order asked"
    assert popped[0] != popped[1]
    assert wrapper.ledger_size == 0


def test_snapshot_reflects_the_wrapper_and_is_a_copy():
    """``snapshot`` is what ``rollout_state`` sends over Ray: every field must be the wrapper's
    own at that moment, and later changes to the wrapper must not reach an earlier snapshot."""
    async def main():
        engine = StreamingScriptedServer()
        wrapper = PartialRolloutServer(engine, policy_version=3)
        wrapper.track(["traj-0"])
        task = asyncio.create_task(wrapper.generate("traj-0", list(PROMPT), PARAMS))
        await _until(lambda: engine.running.get("traj-0", 0) >= 5, "5 tokens before the snapshot")
        running = wrapper.snapshot()
        await wrapper.pause()
        paused = wrapper.snapshot()
        wrapper.unpause(7)
        await task
        return wrapper, running, paused, wrapper.snapshot()

    wrapper, running, paused, done = _run(main())
    assert isinstance(running, PartialRolloutState)
    assert (running.policy_version, running.paused, running.in_engine, running.ledger_size) == (3, False, 1, 1)
    assert running.stats == {"resumed_calls": 0, "interrupted_calls": 0, "updates": 0}
    assert (paused.policy_version, paused.paused, paused.in_engine) == (3, True, 0)
    assert paused.stats == {"resumed_calls": 1, "interrupted_calls": 1, "updates": 0}
    assert (done.policy_version, done.paused, done.in_engine, done.ledger_size) == (7, False, 0, 1)
    assert done.stats == {"resumed_calls": 1, "interrupted_calls": 1, "updates": 1}
    assert done.busy_seconds == pytest.approx(wrapper.busy_seconds()), "no engine call ran since"

    wrapper.stats["updates"] += 10
    wrapper.pop_ledger("traj-0")
    assert done.stats["updates"] == 1, "the snapshot's stats must be a copy, not the wrapper's dict"
    assert done.ledger_size == 1
    assert wrapper.snapshot().ledger_size == 0
    with pytest.raises(dataclasses.FrozenInstanceError):
        done.policy_version = 8


def test_local_rollout_control_satisfies_the_protocol_and_refuses_a_bare_engine():
    engine = StreamingScriptedServer()
    control = LocalRolloutControl(PartialRolloutServer(engine))
    assert isinstance(control, RolloutControl)
    assert not isinstance(control.server, RolloutControl), "the wrapper itself is not a control"
    with pytest.raises(TypeError, match=r"got StreamingScriptedServer; wrap the engine first: "
                                        r"PartialRolloutServer\(engine\)"):
        LocalRolloutControl(engine)


def test_local_rollout_control_pause_push_unpause_resumes_from_exactly_the_kept_ids():
    """The trainer's weight push through :class:`LocalRolloutControl`: ``pause`` aborts the
    in-flight generation, the push reaches the engine with nothing running, ``unpause(9)``
    resumes it from the prompt plus exactly its tokens so far, and the ledger read back through
    the control marks the tokens after the switch with version 9."""
    async def main():
        engine = StreamingScriptedServer()
        control = LocalRolloutControl(PartialRolloutServer(engine))
        await control.set_policy_version(4)
        await control.track(["traj-0"])
        task = asyncio.create_task(control.server.generate("traj-0", list(PROMPT), PARAMS))
        await _until(lambda: engine.running.get("traj-0", 0) >= 5, "5 tokens before the update")
        await control.pause()
        paused = await control.rollout_state()
        await control.update_weights([("w", 1)])
        await control.unpause(9)
        out = await task
        return engine, paused, out, await control.pop_ledger_many(["traj-0"]), await control.rollout_state()

    engine, paused, out, ledger, state = _run(main())
    assert paused.paused, paused
    assert paused.in_engine == 0, paused
    assert paused.stats["interrupted_calls"] == 1, paused
    assert engine.pushes == [({"w": 1}, set())], "one push, forwarded while no engine call ran"
    first, second = engine.calls
    k = PARAMS["max_tokens"] - second.sampling_params.max_tokens
    assert 5 <= k < PARAMS["max_tokens"], "the pause cut the generation between its 5th and last token"
    assert second.prompt_ids == PROMPT + out.token_ids[:k], "resumed from the prompt plus exactly the ids so far"
    assert out.token_ids == _reply("", PROMPT, 0)[: PARAMS["max_tokens"]]
    versions = [4] * k + [9] * (PARAMS["max_tokens"] - k)
    assert out.extra["policy_versions"] == versions
    assert out.extra["resumes"] == 1
    assert ledger == [(out.token_ids, versions)]
    assert (state.policy_version, state.paused, state.ledger_size) == (9, False, 0), state
    assert state.stats == {"resumed_calls": 1, "interrupted_calls": 1, "updates": 1}
