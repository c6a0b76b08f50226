"""The thread switch interval is short while a batch is in flight, and restored after it."""

from __future__ import annotations

import asyncio
import sys

import pytest

import agentloop_core.testing.loops  # noqa: F401  registers test_chat
from agentloop_core import AgentLoopWorker, RolloutConfig
from agentloop_core.runtime.switch_interval import SWITCH_INTERVAL, SwitchIntervalHold
from agentloop_core.testing import ScriptedServer, load_tiny_tokenizer
from agentloop_core.testing.loops import TEST_CHAT_AGENT


@pytest.fixture(autouse=True)
def python_default_interval():
    before = sys.getswitchinterval()
    sys.setswitchinterval(0.005)
    yield
    sys.setswitchinterval(before)


def test_held_at_most_the_interval_and_restored_after():
    hold = SwitchIntervalHold()
    with hold.holding(0.001):
        assert sys.getswitchinterval() == pytest.approx(0.001)
        assert hold.held
    assert sys.getswitchinterval() == pytest.approx(0.005)
    assert not hold.held


def test_never_raised_above_what_the_process_set():
    sys.setswitchinterval(0.0002)
    with SwitchIntervalHold().holding(0.001):
        assert sys.getswitchinterval() == pytest.approx(0.0002)
    assert sys.getswitchinterval() == pytest.approx(0.0002)


def test_overlapping_holds_restore_once_when_the_last_returns():
    hold = SwitchIntervalHold()
    hold.acquire(0.002)
    hold.acquire(0.001)  # a second batch asks for less: it gets it
    assert sys.getswitchinterval() == pytest.approx(0.001)
    hold.release()
    assert sys.getswitchinterval() == pytest.approx(0.001)  # one batch is still in flight
    hold.release()
    assert sys.getswitchinterval() == pytest.approx(0.005)
    with pytest.raises(RuntimeError, match="without a matching acquire"):
        hold.release()


def test_a_change_made_during_the_hold_is_kept():
    with SwitchIntervalHold().holding(0.001):
        sys.setswitchinterval(0.003)  # the user's own setting, mid-batch
    assert sys.getswitchinterval() == pytest.approx(0.003)


def test_none_changes_nothing():
    with SwitchIntervalHold().holding(None):
        assert sys.getswitchinterval() == pytest.approx(0.005)


def _run_batch(switch_interval_s: float | None) -> set[float]:
    seen: set[float] = set()

    class Recording(ScriptedServer):
        async def generate(self, *args, **kwargs):
            seen.add(round(sys.getswitchinterval(), 6))
            return await super().generate(*args, **kwargs)

    worker = AgentLoopWorker(Recording(), load_tiny_tokenizer(), {
        "sampling_params": {"max_tokens": 4}, "switch_interval_s": switch_interval_s})
    rows = [{"agent_name": TEST_CHAT_AGENT, "raw_prompt": [{"role": "user", "content": f"q{i}"}]} for i in range(3)]
    outs = asyncio.run(worker.generate_sequences(rows))
    assert len(outs) == 3
    assert not any(o.failed for o in outs)
    return seen


@pytest.mark.parametrize(("setting", "during"), [(0.001, {0.001}), (0.0005, {0.0005}), (None, {0.005})])
def test_the_worker_holds_its_interval_only_while_its_batch_runs(setting, during):
    assert _run_batch(setting) == during
    assert sys.getswitchinterval() == pytest.approx(0.005)
    assert not SWITCH_INTERVAL.held


def test_the_default_is_two_milliseconds():
    assert RolloutConfig().switch_interval_s == 0.002


@pytest.mark.parametrize("bad", [0, -0.001, True, "0.001"])
def test_a_bad_interval_is_refused_with_its_name(bad):
    with pytest.raises(ValueError, match=r"switch_interval_s must be a positive number of seconds or None"):
        RolloutConfig.from_mapping({"switch_interval_s": bad})
