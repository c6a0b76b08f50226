"""StickyLeastInFlightPolicy's cost-model gate: a sticky request moves only when the least-loaded
replica serves it faster even after re-prefilling its whole prompt there.

Every test uses ``saturation_batch=4, prefill_token_cost=0.1, expected_decode_tokens=100``, so
costs are easy to check by hand: expected cost = (prefill tokens x 0.1 + 100) x
max(1, (in flight + 1) / 4).
"""

from __future__ import annotations

import pytest

from agentloop_engines.fleet.routing import StickyLeastInFlightPolicy


def make(n: int = 2, **kw) -> StickyLeastInFlightPolicy:
    params = dict(saturation_batch=4, prefill_token_cost=0.1, expected_decode_tokens=100)
    return StickyLeastInFlightPolicy(n, **{**params, **kw})


def load(policy: StickyLeastInFlightPolicy, index: int, requests: int) -> None:
    for _ in range(requests):
        policy.acquire(index)


def test_first_placement_goes_to_the_least_loaded_replica():
    """A new session must go to the replica with the fewest requests in flight, whatever its
    prompt length (a hash would ignore load). Debug: the ``pinned is None`` branch of choose."""
    policy = make(3)
    load(policy, 0, 5)
    load(policy, 1, 2)
    load(policy, 2, 7)
    assert policy.choose("new", prompt_tokens=10_000) == 1
    assert policy.stats.new_sessions == 1
    assert policy.session_replica("new") == 1


def test_sticky_while_every_replica_is_below_saturation():
    """Below ``saturation_batch`` a replica serves at full speed, so moving only adds prefill:
    the session must stay even when its replica is 3 requests busier."""
    policy = make()
    assert policy.choose("t", prompt_tokens=100) == 0
    load(policy, 0, 3)  # (3 + 1) / 4 = 1: no slowdown yet
    assert policy.choose("t", prompt_tokens=200) == 0
    assert policy.stats.migrations == 0
    assert policy.stats.sticky_hits == 1


def test_sticky_when_balanced_even_if_saturated():
    """Equal load everywhere: the pinned replica is never worse, so the session stays."""
    policy = make()
    assert policy.choose("t", prompt_tokens=100) == 0
    load(policy, 0, 20)
    load(policy, 1, 20)
    assert policy.choose("t", prompt_tokens=150) == 0
    assert policy.stats.migrations == 0


def test_moves_a_cheap_prefix_off_a_much_busier_replica():
    """Pinned replica 11 in flight (slowdown 3), the other idle: staying costs
    (100 new tokens x 0.1 + 100) x 3 = 330, moving (1100 x 0.1 + 100) x 1 = 210, so it moves and
    the session is re-pinned there."""
    policy = make()
    assert policy.choose("t", prompt_tokens=1000) == 0
    load(policy, 0, 11)
    assert policy.expected_cost(0, 100) == pytest.approx(330)
    assert policy.expected_cost(1, 1100) == pytest.approx(210)
    assert policy.choose("t", prompt_tokens=1100) == 1
    assert policy.stats.migrations == 1
    assert policy.session_replica("t") == 1
    # Re-pinned with its new prefix: the next turn stays on replica 1.
    assert policy.choose("t", prompt_tokens=1200) == 1


def test_keeps_an_expensive_prefix_on_the_same_busy_replica():
    """Same load as above, but a 4900-token cached prefix: moving costs (5000 x 0.1 + 100) = 600
    > staying 330, so the long trajectory keeps its prefix cache."""
    policy = make()
    assert policy.choose("long", prompt_tokens=4900) == 0
    load(policy, 0, 11)
    assert policy.choose("long", prompt_tokens=5000) == 0
    assert policy.stats.migrations == 0


def test_migration_threshold_follows_the_load_difference():
    """With a 1000-token prefix, moving costs 210 (to an idle replica); staying costs
    110 x (in flight + 1) / 4: 7 in flight gives 220 (> 210, moves), 6 gives 192.5 (stays)."""
    stays, moves = make(), make()
    for policy, busy in ((stays, 6), (moves, 7)):
        assert policy.choose("t", prompt_tokens=1000) == 0
        load(policy, 0, busy)
    assert stays.choose("t", prompt_tokens=1100) == 0
    assert moves.choose("t", prompt_tokens=1100) == 1


def test_without_a_prompt_length_the_count_gate_decides():
    """No prompt length (a chat request): move when more than ``imbalance_threshold`` extra
    requests are in flight, regardless of the cost model."""
    policy = make(imbalance_threshold=2)
    assert policy.choose("t") == 0
    load(policy, 0, 2)
    assert policy.choose("t") == 0
    policy.acquire(0)
    assert policy.choose("t") == 1


def test_threshold_none_never_migrates_even_when_the_cost_model_would():
    policy = make(imbalance_threshold=None)
    assert policy.choose("t", prompt_tokens=10) == 0
    load(policy, 0, 100)
    assert policy.choose("t", prompt_tokens=20) == 0
    assert policy.stats.migrations == 0


@pytest.mark.parametrize("bad", [dict(saturation_batch=0), dict(prefill_token_cost=0.0),
                                 dict(expected_decode_tokens=0)])
def test_rejects_cost_parameters_that_are_not_positive(bad):
    with pytest.raises(ValueError, match="saturation_batch"):
        make(**bad)
