"""SegmentBuilder: calls that extend the segment merge, others start a new one, and every mask-1
token is one the engine generated, in order, with its log-prob."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agentloop_core.output import AgentLoopOutput
from agentloop_core.protocol import TokenOutput
from agentloop_core.segments import SegmentBuilder, trajectory_reward, trajectory_view


def test_extending_calls_merge_with_the_gap_as_mask_0_tokens():
    b = SegmentBuilder()
    assert b.add_call([1, 2], [3, 4], [-0.3, -0.4], "stop") == 0
    # tool result [9, 9] between the last generated token and the next generation
    assert b.add_call([1, 2, 3, 4, 9, 9], [5], [-0.5], "length") == 0
    assert b.add_call([1, 2, 3, 4, 9, 9, 5], [6], [-0.6]) == 0  # nothing in between
    (out,) = b.outputs(reward_score=1.0, num_turns=5, metrics={"generate_s": 0.1}, extra_fields={"k": 1})
    assert out.prompt_ids == [1, 2]
    assert out.response_ids == [3, 4, 9, 9, 5, 6]
    assert out.response_mask == [1, 1, 0, 0, 1, 1]
    assert out.response_logprobs == [-0.3, -0.4, 0.0, 0.0, -0.5, -0.6]
    assert out.reward_score == 1.0
    assert out.num_turns == 5
    assert out.segment_index == 0
    assert out.metrics == {"generate_s": 0.1}
    assert out.extra_fields == {"k": 1, "stop_reasons": ["stop", "length", None]}
    assert b.num_calls == 3
    assert b.num_segments == 1


def test_a_rewritten_prompt_starts_a_new_segment():
    b = SegmentBuilder()
    b.add_call([1, 2], [3, 4], [-0.3, -0.4])
    b.add_call([1, 2, 3, 4, 8], [5], [-0.5])
    # the agent summarised its history: the prompt no longer holds what was generated
    assert b.add_output([1, 7], TokenOutput([6, 6], [-0.6, -0.7])) == 1
    assert b.add_call([1, 7, 6, 6, 8], [2], [-0.2]) == 1
    # the same prompt as before but a token shorter than the segment: not an extension
    assert b.add_call([1, 7, 6, 6], [3], [-0.1]) == 2
    first, second, third = b.outputs(reward_score=0.5)
    assert (first.prompt_ids, first.response_ids, first.response_mask) == ([1, 2], [3, 4, 8, 5], [1, 1, 0, 1])
    assert (second.prompt_ids, second.response_ids, second.response_mask) == ([1, 7], [6, 6, 8, 2], [1, 1, 0, 1])
    assert second.response_logprobs == [-0.6, -0.7, 0.0, -0.2]
    assert (third.prompt_ids, third.response_ids) == ([1, 7, 6, 6], [3])
    assert [o.segment_index for o in (first, second, third)] == [0, 1, 2]
    assert all(o.reward_score == 0.5 and o.trajectory_index is None for o in (first, second, third))
    assert "stop_reasons" not in first.extra_fields  # no call recorded one


def test_from_calls_takes_recorded_calls_in_order():
    from types import SimpleNamespace as Call

    calls = [Call(prompt_ids=[1], token_ids=[2], log_probs=[-0.2], stop_reason="stop"),
             Call(prompt_ids=[1, 2, 5], token_ids=[3], log_probs=[-0.3], stop_reason="length")]
    (out,) = SegmentBuilder.from_calls(calls).outputs()
    assert out.response_ids == [2, 5, 3]
    assert out.extra_fields["stop_reasons"] == ["stop", "length"]


def test_without_log_probs_the_outputs_have_none():
    b = SegmentBuilder()
    b.add_call([1], [2, 3])
    b.add_call([1, 2, 3, 4], [5])
    b.add_call([1, 9], [])  # a call that generated nothing may carry no log-probs either way
    outs = b.outputs()
    assert [o.response_logprobs for o in outs] == [None, None]
    assert outs[1].response_ids == []
    assert outs[1].prompt_ids == [1, 9]


def test_bad_input_is_named_with_the_fix():
    with pytest.raises(ValueError, match="no generate calls were recorded; call add_call"):
        SegmentBuilder().outputs()
    b = SegmentBuilder()
    with pytest.raises(ValueError, match=r"call 0: 2 token ids but 1 log-probs; pass the engine's TokenOutput.log_probs"):
        b.add_call([1], [2, 3], [-0.1])
    with pytest.raises(ValueError, match="call 0: prompt_ids is empty"):
        b.add_call([], [2])
    with pytest.raises(ValueError, match="stop_reason 'eos' is not one of"):
        b.add_call([1], [2], None, "eos")
    b.add_call([1], [2], [-0.1])
    with pytest.raises(ValueError, match="call 1 has no log-probs but earlier calls do; ask the engine"):
        b.add_call([1, 2], [3])
    assert b.num_calls == 1  # a rejected call leaves no trace
    (out,) = b.outputs()
    assert out.response_ids == [2]


def test_trajectory_reward_and_view():
    segs = [
        AgentLoopOutput([1], [2, 8], [1, 0], [-0.2, 0.0], reward_score=None, num_turns=2, metrics={"a": 1}),
        AgentLoopOutput([5], [3], [1], [-0.3], reward_score=2.0, num_turns=4, metrics={"b": 2},
                        extra_fields={"messages": ["m"]}, segment_index=1),
    ]
    assert trajectory_reward(segs) == 2.0
    view = trajectory_view(segs)
    assert view.prompt_ids == [1]
    assert view.response_ids == [2, 8, 3]
    assert view.response_mask == [1, 0, 1]
    assert view.response_logprobs == [-0.2, 0.0, -0.3]
    assert view.reward_score == 2.0
    assert view.num_turns == 4
    assert view.extra_fields == {"messages": ["m"]}
    view.metrics["reward/function"] = 1.0
    assert segs[1].metrics == {"b": 2}  # the view's metrics are a copy
    assert trajectory_view(segs[:1]) is segs[0]
    segs[0].reward_score = 1.0
    with pytest.raises(ValueError, match="segment 0 has reward_score 1.0 but the last segment has 2.0"):
        trajectory_reward(segs)
    segs[0].reward_score = segs[1].reward_score = math.nan
    assert math.isnan(trajectory_reward(segs))


# -- properties -----------------------------------------------------------------------------

tokens = st.lists(st.integers(0, 20), max_size=6)


@st.composite
def call_scripts(draw):
    """A trajectory's calls: each extends the context, rewrites it, or drops its tail."""
    calls = []
    context: list[int] = []
    for _ in range(draw(st.integers(1, 8))):
        kind = draw(st.sampled_from(["extend", "rewrite", "shorten"])) if context else "rewrite"
        if kind == "extend":
            prompt = context + draw(tokens)
        elif kind == "shorten":
            prompt = context[: draw(st.integers(1, len(context)))]
        else:
            prompt = draw(st.lists(st.integers(0, 20), min_size=1, max_size=8))
        generated = draw(tokens)
        log_probs = [-(i + 1) / 7 - t / 100 for i, t in enumerate(generated)]
        calls.append((prompt, generated, log_probs))
        context = prompt + generated
    return calls


@settings(max_examples=300, deadline=None)
@given(call_scripts())
def test_mask_1_tokens_are_exactly_the_generated_tokens(calls):
    b = SegmentBuilder()
    placed = [b.add_call(p, g, lp) for p, g, lp in calls]
    outs = b.outputs()
    # Every generated token, in order, is a mask-1 token with the engine's log-prob; nothing else is.
    generated = [t for _, g, _ in calls for t in g]
    generated_lp = [x for _, _, lp in calls for x in lp]
    trained = [t for o in outs for t, m in zip(o.response_ids, o.response_mask, strict=True) if m]
    trained_lp = [x for o in outs for x, m in zip(o.response_logprobs, o.response_mask, strict=True) if m]
    assert trained == generated
    assert trained_lp == generated_lp
    assert all(x == 0.0 for o in outs for x, m in zip(o.response_logprobs, o.response_mask, strict=True) if not m)
    # Each call saw a prefix of its segment: its prompt and generation sit in the row in place.
    for (prompt, gen, _), k in zip(calls, placed, strict=True):
        row = outs[k].prompt_ids + outs[k].response_ids
        assert row[: len(prompt) + len(gen)] == prompt + gen
        start = len(prompt) - len(outs[k].prompt_ids)
        assert outs[k].response_mask[start : start + len(gen)] == [1] * len(gen)
    # A new segment starts exactly where a prompt does not extend the previous call.
    splits = [
        i for i in range(1, len(calls))
        if calls[i][0][: len(calls[i - 1][0]) + len(calls[i - 1][1])] != calls[i - 1][0] + calls[i - 1][1]
    ]  # fmt: skip
    assert len(outs) == 1 + len(splits)
    assert placed == sorted(placed)
    assert [o.prompt_ids for o in outs] == [calls[0][0]] + [calls[i][0] for i in splits]
    assert [o.segment_index for o in outs] == list(range(len(outs)))
