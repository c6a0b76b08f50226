"""The staleness-bounded GRPO buffer: the bound is never exceeded, groups are never split, and
the producer/consumer pair never deadlocks, whatever order groups finish in."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agentloop_trainer.stages import StalenessBuffer, staleness_metrics


def test_max_staleness_zero_is_synchronous():
    buf = StalenessBuffer(batch_groups=2, max_staleness=0)
    a, b = buf.start(0), buf.start(0)
    assert not buf.can_start(0), "a synchronous step rolls out exactly one batch"
    buf.finish(b, "b")
    assert not buf.ready()
    buf.finish(a, "a")
    assert [g.payload for g in buf.take()] == ["a", "b"]
    assert buf.can_start(1)


def test_a_slow_group_is_not_passed_over_until_too_stale():
    """Finishing order would starve group 0; due-first takes it at step max_staleness."""
    buf = StalenessBuffer(batch_groups=1, max_staleness=1)
    slow, fast = buf.start(0), buf.start(0)
    buf.finish(fast, "fast")
    assert buf.ready()
    assert [g.payload for g in buf.take()] == ["fast"]  # step 0: slow is not due yet
    buf.finish(buf.start(1), "next")
    assert buf.due() == [slow]
    assert not buf.ready(), "step 1 must wait for the due group even though another one finished"
    buf.finish(slow, "slow")
    assert [g.payload for g in buf.take()] == ["slow"]


def test_admission_and_misuse_errors_name_the_fix():
    buf = StalenessBuffer(batch_groups=1, max_staleness=1)
    buf.start(0)
    buf.start(0)
    with pytest.raises(RuntimeError, match="wait for the next weight update"):
        buf.start(0)
    with pytest.raises(RuntimeError, match="not ready"):
        buf.take()
    with pytest.raises(ValueError, match="max_staleness must be >= 0"):
        StalenessBuffer(1, -1)
    with pytest.raises(ValueError, match="batch_groups must be at least 1"):
        StalenessBuffer(0, 1)


def test_metrics_histogram_and_tokens_per_version():
    buf = StalenessBuffer(batch_groups=2, max_staleness=2)
    groups = [buf.start(0), buf.start(0), buf.start(0)]
    for g in groups:
        g.token_versions.update({0: 3})
        buf.finish(g, None)
    buf.take()
    g3 = buf.start(1)
    g3.token_versions.update({1: 5})
    buf.finish(g3, None)
    batch = buf.take()
    m = staleness_metrics(1, batch, 2)
    assert m["staleness/max"] == 1
    assert m["staleness/mean"] == 0.5
    assert m["staleness/hist_0"] == m["staleness/hist_1"] == 0.5
    assert m["staleness/hist_2"] == 0
    assert m["staleness/tokens_lag_1"] == 3
    assert m["staleness/tokens_lag_0"] == 5


@settings(max_examples=300, deadline=None)
@given(batch_groups=st.integers(1, 4), max_staleness=st.integers(0, 3), steps=st.integers(1, 8),
       choices=st.lists(st.integers(0, 2**16), min_size=200, max_size=200))
def test_staleness_is_never_exceeded_and_groups_are_never_split(batch_groups, max_staleness, steps, choices):
    """A random interleaving of starts, finishes (in any order) and training steps: every trained
    group is within the bound, each batch is exactly batch_groups whole groups, no group is
    trained twice or lost, the buffer depth stays bounded, and the run always makes progress."""
    buf = StalenessBuffer(batch_groups, max_staleness)
    version = 0
    updating = False  # between taking a batch and pushing its update: rollout goes on meanwhile
    running = []
    trained: list[int] = []
    picks = iter(choices * 50)
    while buf.trained_steps < steps:
        actions = []
        if buf.can_start(version):
            actions.append("start")
        if running:
            actions.append("finish")
        if updating:
            actions.append("update")
        elif buf.ready():
            actions.append("train")
        assert actions, "deadlock: nothing can start, finish or train"
        action = actions[next(picks) % len(actions)]
        if action == "start":
            group = buf.start(version)
            # The payload is the group's n samples, all tagged with the group.
            running.append(group)
        elif action == "finish":
            group = running.pop(next(picks) % len(running))
            buf.finish(group, [(group.index, k) for k in range(3)])
        elif action == "update":
            version, updating = version + 1, False
        else:
            step = buf.trained_steps
            assert step == version
            batch = buf.take()
            assert len(batch) == batch_groups
            for g in batch:
                assert 0 <= step - g.start_version <= max_staleness
                assert g.payload == [(g.index, k) for k in range(3)], "a group's samples stay together"
            trained.extend(g.index for g in batch)
            updating = True
        assert buf.depth <= (max_staleness + 1) * batch_groups
        assert buf.started - len(trained) <= (max_staleness + 1) * batch_groups
    assert len(trained) == len(set(trained)) == steps * batch_groups
