"""GcHold: full collections held off (and the old heap frozen) while rollouts are in flight."""

from __future__ import annotations

import asyncio
import gc

import pytest

import agentloop_core.testing.loops  # noqa: F401  registers test_chat
from agentloop_core.runtime import AgentLoopWorker
from agentloop_core.runtime.gc_hold import GC_HOLD, GcHold
from agentloop_core.testing import ScriptedServer, load_tiny_tokenizer
from agentloop_core.testing.loops import TEST_CHAT_AGENT


@pytest.fixture(autouse=True)
def _clean_gc_state():
    """Each test starts and ends with nothing frozen and the process's own thresholds."""
    thresholds = gc.get_threshold()
    gc.unfreeze()
    yield
    gc.unfreeze()
    gc.set_threshold(*thresholds)


class Cycle:
    """One object in a reference cycle with itself, counted when freed."""

    freed = 0

    def __init__(self) -> None:
        self.me = self

    def __del__(self) -> None:
        Cycle.freed += 1


def test_a_hold_freezes_the_old_heap_and_turns_full_collections_off_until_the_last_release():
    hold = GcHold()
    gen0, gen1, gen2 = gc.get_threshold()
    hold.acquire()
    assert gc.get_freeze_count() > 0
    assert gc.get_threshold()[:2] == (gen0, gen1)
    assert gc.get_threshold()[2] > 1_000_000
    hold.acquire()  # a second batch in flight
    hold.release()
    assert hold.held, "released while a batch was still in flight"
    assert gc.get_freeze_count() > 0, "unfrozen while a batch was still in flight"
    hold.release()
    assert not hold.held
    assert gc.get_freeze_count() == 0
    assert gc.get_threshold() == (gen0, gen1, gen2)
    with pytest.raises(RuntimeError, match="without a matching acquire"):
        hold.release()


def test_garbage_made_during_a_hold_is_freed_after_it():
    Cycle.freed = 0
    hold = GcHold()
    with hold.holding():
        young = Cycle()  # made inside the hold: not frozen
        del young
        gc.collect(0)  # a young collection still frees a young cycle
        assert Cycle.freed == 1
    Cycle.freed = 0
    kept = Cycle()
    with hold.holding():
        # `kept` existed before the hold: frozen, so no collection, full or young, frees it.
        del kept
        gc.collect(0)
        gc.collect(1)
        assert Cycle.freed == 0
    gc.collect()
    assert Cycle.freed == 1, "the frozen cycle was not freed once the hold ended"


def test_a_hold_past_its_limit_runs_one_full_collection_at_a_batch_end():
    Cycle.freed = 0
    hold = GcHold(max_hold_s=0.0)
    kept = Cycle()
    hold.acquire()
    hold.acquire()
    del kept
    hold.release()  # one batch ends while the other is in flight: the hold is past 0 s
    assert hold.breaks == 1
    assert Cycle.freed == 1
    assert hold.held
    assert gc.get_freeze_count() > 0
    hold.release()
    assert gc.get_freeze_count() == 0


def test_a_heap_frozen_by_someone_else_stays_frozen():
    gc.freeze()
    theirs = gc.get_freeze_count()
    hold = GcHold()
    with hold.holding():
        assert gc.get_threshold()[2] > 1_000_000
    assert gc.get_freeze_count() == theirs


def test_disabled_changes_nothing():
    before = gc.get_threshold()
    with GcHold().holding(enabled=False):
        assert gc.get_threshold() == before
        assert gc.get_freeze_count() == 0


def _worker(hold_full_gc: bool) -> tuple[AgentLoopWorker, list[tuple[int, int, int]]]:
    seen: list[tuple[int, int, int]] = []

    class Recording(ScriptedServer):
        async def generate(self, *args, **kwargs):
            seen.append(gc.get_threshold())
            return await super().generate(*args, **kwargs)

    worker = AgentLoopWorker(Recording(), load_tiny_tokenizer(), {
        "sampling_params": {"max_tokens": 4}, "hold_full_gc": hold_full_gc})
    return worker, seen


@pytest.mark.parametrize("hold_full_gc", [True, False])
def test_the_worker_holds_full_collections_only_while_its_batch_runs(hold_full_gc):
    before = gc.get_threshold()
    worker, seen = _worker(hold_full_gc)
    rows = [{"agent_name": TEST_CHAT_AGENT, "raw_prompt": [{"role": "user", "content": f"q{i}"}]} for i in range(3)]
    outs = asyncio.run(worker.generate_sequences(rows))
    assert len(outs) == 3
    assert not any(o.failed for o in outs)
    assert seen, "the engine was never called"
    held = {t[2] > 1_000_000 for t in seen}
    assert held == {hold_full_gc}
    assert gc.get_threshold() == before
    assert not GC_HOLD.held
    assert gc.get_freeze_count() == 0
