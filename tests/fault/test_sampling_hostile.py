"""Hostile sampling values (issue 18): every engine must refuse a non-finite or degenerate
sampling value up front, naming the key and its valid range, instead of sampling garbage or
crashing deep inside a batch. Both the scripted engine and :class:`AsyncServerBase` go through
:class:`SamplingParams`, so a failure here points at ``SamplingParams.check``."""

from __future__ import annotations

import math

import pytest

from agentloop_core.protocol import SamplingParams
from agentloop_core.testing.scripted import ScriptedServer

BAD = [
    ("temperature", math.nan, r"temperature.*finite"),
    ("temperature", math.inf, r"temperature.*finite"),
    ("temperature", -0.5, r"temperature must be >= 0"),
    ("temperature", "hot", r"temperature.*number"),
    ("top_p", math.nan, r"top_p.*\(0, 1\]"),
    ("top_p", 0.0, r"top_p.*\(0, 1\]"),
    ("top_p", 1.5, r"top_p.*\(0, 1\]"),
    ("top_p", -math.inf, r"top_p.*\(0, 1\]"),
    ("top_k", -2, r"top_k.*-1"),
    ("top_k", 2.5, r"top_k.*integer"),
    ("top_k", True, r"top_k.*integer"),
    ("max_tokens", 0, r"max_tokens.*>= 1"),
    ("max_tokens", math.nan, r"max_tokens.*integer"),
    ("seed", 2**63, r"seed.*int64"),
    ("seed", -(2**63) - 1, r"seed.*int64"),
    ("seed", 1.5, r"seed.*integer"),
]


@pytest.mark.parametrize(("key", "value", "match"), BAD, ids=[f"{k}={v!r}" for k, v, _ in BAD])
def test_bad_sampling_value_is_refused_naming_key_and_range(key, value, match):
    """A bad value must raise ValueError naming the key and the valid range, from a mapping and
    from direct construction alike (a typed SamplingParams skips ``from_mapping``'s check)."""
    with pytest.raises(ValueError, match=match):
        SamplingParams.from_mapping({key: value})
    with pytest.raises(ValueError, match=match):
        SamplingParams(**{key: value})


@pytest.mark.parametrize(
    "good",
    [{"temperature": 0.0}, {"top_p": 1.0}, {"top_k": -1}, {"top_k": 0}, {"top_k": 50},
     {"seed": 2**63 - 1}, {"seed": -(2**63)}, {"temperature": 1}, {"max_tokens": 1}],
)
def test_edge_values_stay_valid(good):
    """The boundaries of every range (greedy, disabled top-k, int64 seeds) stay accepted."""
    SamplingParams.from_mapping(good)


async def test_scripted_engine_refuses_nan_temperature():
    """The engine path refuses a NaN temperature before generating anything."""
    engine = ScriptedServer()
    with pytest.raises(ValueError, match="temperature"):
        await engine.generate("r", [1, 2], {"temperature": math.nan})
    assert engine.calls == []
