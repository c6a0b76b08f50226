"""Segments: one trajectory's engine calls as one or more :class:`AgentLoopOutput` s.

An agent that edits its own context (summarises, trims or rewrites earlier turns) makes
calls whose prompt is not the previous prompt plus what the engine generated. There is then
no single token sequence holding every generated token in the context the engine saw it in,
and re-tokenizing the edited text would train on tokens the engine never sampled. So a
trajectory becomes several rows, each a prefix-consistent run of calls:

- a call whose ``prompt_ids`` start with the segment so far (the previous call's prompt
  plus its generated ids) joins that segment: the prompt tokens past that prefix (tool
  results, user turns, template glue) become mask-0 response tokens with log-prob 0.0, and
  its generated ids become mask-1 tokens with the engine's log-probs;
- any other call starts a new segment whose prompt is the call's own ``prompt_ids``.

A loop that never edits its context gets one segment, identical to what
:class:`~agentloop_core.tokenization.Trajectory` builds. Each mask-1 token is one the engine
returned, in order, with its log-prob: nothing is re-tokenized.

The worker numbers the segments (``trajectory_index``, ``segment_index``), scores the
trajectory once and gives every segment its reward; GRPO computes one advantage per
trajectory and broadcasts it to the segments.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from agentloop_core.output import AgentLoopOutput
from agentloop_core.protocol import STOP_REASONS, TokenOutput


class Call(Protocol):
    """What a recorded ``generate`` call needs to hold (the HTTP gateway's ``RecordedCall`` does)."""

    prompt_ids: Sequence[int]
    token_ids: Sequence[int]
    log_probs: Sequence[float] | None
    stop_reason: str | None


@dataclass
class _Segment:
    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    response_mask: list[int] = field(default_factory=list)
    response_logprobs: list[float] = field(default_factory=list)
    stop_reasons: list[str | None] = field(default_factory=list)

    @property
    def context(self) -> list[int]:
        """What the next call's prompt must start with to join this segment."""
        return self.prompt_ids + self.response_ids


class SegmentBuilder:
    """Records a trajectory's ``generate`` calls and splits them into segments.

    Example::

        builder = SegmentBuilder()
        out = await server.generate(rid, prompt_ids, params)
        builder.add_call(prompt_ids, out.token_ids, out.log_probs, out.stop_reason)
        ...  # more calls, on extended or rewritten prompts
        return builder.outputs(reward_score=score, metrics={"generate_s": t})
    """

    def __init__(self) -> None:
        self._segments: list[_Segment] = []
        self._num_calls = 0
        # Decided by the first call with tokens or log-probs; an empty generation may lack them.
        self._with_logprobs: bool | None = None

    @classmethod
    def from_calls(cls, calls: Iterable[Call]) -> SegmentBuilder:
        """A builder holding ``calls`` (objects with ``prompt_ids``, ``token_ids``,
        ``log_probs`` and ``stop_reason``), in order.

        Raises:
            ValueError: as :meth:`add_call`.
        """
        builder = cls()
        for call in calls:
            builder.add_call(call.prompt_ids, call.token_ids, call.log_probs, call.stop_reason)
        return builder

    @property
    def num_calls(self) -> int:
        """Calls recorded so far."""
        return self._num_calls

    @property
    def num_segments(self) -> int:
        """Segments so far."""
        return len(self._segments)

    def add_call(
        self,
        prompt_ids: Sequence[int],
        token_ids: Sequence[int],
        log_probs: Sequence[float] | None = None,
        stop_reason: str | None = None,
    ) -> int:
        """Record one ``generate`` call.

        Args:
            prompt_ids: The prompt exactly as sent to the engine.
            token_ids: The ids the engine returned (``TokenOutput.token_ids``).
            log_probs: The engine's log-prob of each returned id, or None when not requested.
                Every call that generated tokens must have them, or none.
            stop_reason: ``TokenOutput.stop_reason`` (kept in the segment's
                ``extra_fields["stop_reasons"]``), or None.

        Returns:
            The index of the segment the call went to.

        Raises:
            ValueError: an empty prompt, a log-prob count that differs from the token count,
                log-probs on some calls only, or an unknown stop reason.
        """
        n = self._num_calls
        prompt = [int(t) for t in prompt_ids]
        tokens = [int(t) for t in token_ids]
        if not prompt:
            raise ValueError(f"call {n}: prompt_ids is empty; record the prompt ids the engine was given")
        if stop_reason is not None and stop_reason not in STOP_REASONS:
            raise ValueError(f"call {n}: stop_reason {stop_reason!r} is not one of {STOP_REASONS} (or None)")
        if log_probs is not None and len(log_probs) != len(tokens):
            raise ValueError(
                f"call {n}: {len(tokens)} token ids but {len(log_probs)} log-probs; pass the engine's "
                "TokenOutput.log_probs for exactly the tokens it returned"
            )
        has = log_probs is not None
        if self._with_logprobs is None and (tokens or has):
            self._with_logprobs = has
        elif tokens and has != self._with_logprobs:
            raise ValueError(
                f"call {n} has {'' if has else 'no '}log-probs but earlier calls "
                f"{'do not' if has else 'do'}; ask the engine for log-probs on every call of a "
                "trajectory (sampling_params logprobs=True) or on none"
            )
        segment = self._segments[-1] if self._segments else None
        if segment is not None:
            context = segment.context
            if prompt[: len(context)] != context:
                segment = None
        if segment is None:
            segment = _Segment(prompt_ids=prompt)
            self._segments.append(segment)
        else:
            extra = prompt[len(segment.context) :]
            segment.response_ids += extra
            segment.response_mask += [0] * len(extra)
            segment.response_logprobs += [0.0] * len(extra)
        segment.response_ids += tokens
        segment.response_mask += [1] * len(tokens)
        segment.response_logprobs += [float(x) for x in log_probs] if log_probs is not None else [0.0] * len(tokens)
        segment.stop_reasons.append(stop_reason)
        self._num_calls += 1
        return len(self._segments) - 1

    def add_output(self, prompt_ids: Sequence[int], output: TokenOutput) -> int:
        """:meth:`add_call` with what ``generate`` returned."""
        return self.add_call(prompt_ids, output.token_ids, output.log_probs, output.stop_reason)

    def outputs(
        self,
        *,
        reward_score: float | None = None,
        num_turns: int = 0,
        metrics: Mapping[str, Any] | None = None,
        extra_fields: Mapping[str, Any] | None = None,
        multi_modal_data: dict[str, Any] | None = None,
    ) -> list[AgentLoopOutput]:
        """The trajectory's segments, in call order, ready to return from ``run``.

        Every segment gets the trajectory's ``reward_score``, ``num_turns``, ``metrics``,
        ``extra_fields`` and ``multi_modal_data`` (copies of the mappings), plus
        ``extra_fields["stop_reasons"]`` (one per call of the segment) when any call
        recorded a stop reason, and its ``segment_index``.

        Raises:
            ValueError: when no call was recorded.
        """
        if not self._segments:
            raise ValueError(
                "no generate calls were recorded; call add_call(...) after each generate, or raise "
                "(the worker then counts the sample as failed) when the trajectory made none"
            )
        outs = []
        for k, seg in enumerate(self._segments):
            extra = dict(extra_fields or {})
            if any(r is not None for r in seg.stop_reasons):
                extra["stop_reasons"] = list(seg.stop_reasons)
            outs.append(
                AgentLoopOutput(
                    prompt_ids=list(seg.prompt_ids),
                    response_ids=list(seg.response_ids),
                    response_mask=list(seg.response_mask),
                    response_logprobs=list(seg.response_logprobs) if self._with_logprobs else None,
                    multi_modal_data=multi_modal_data,
                    reward_score=reward_score,
                    num_turns=num_turns,
                    metrics=dict(metrics or {}),
                    extra_fields=extra,
                    segment_index=k,
                )
            )
        return outs


def trajectory_reward(segments: Sequence[AgentLoopOutput]) -> float | None:
    """The reward of a trajectory: its last segment's ``reward_score``.

    Raises:
        ValueError: when another segment holds a different reward (segments share one
            reward; set it once, e.g. ``SegmentBuilder.outputs(reward_score=...)``).
    """
    if not segments:
        raise ValueError("a trajectory needs at least one segment")
    reward = segments[-1].reward_score
    for k, seg in enumerate(segments[:-1]):
        r = seg.reward_score
        if r is None or _same(r, reward):
            continue
        raise ValueError(
            f"segment {k} has reward_score {r!r} but the last segment has {reward!r}; the segments of "
            "one trajectory share one reward: set it on every segment (SegmentBuilder.outputs("
            "reward_score=...)) or on the last one only"
        )
    return reward


def _same(a: float | None, b: float | None) -> bool:
    if a is None or b is None:
        return a is b
    return float(a) == float(b) or (math.isnan(float(a)) and math.isnan(float(b)))


def trajectory_view(segments: Sequence[AgentLoopOutput]) -> AgentLoopOutput:
    """One output standing for a whole trajectory, for code that judges a trajectory rather
    than trains on it (the worker's ``reward_fn``).

    A single segment is its own view (the same object). Otherwise: the first segment's
    prompt; as response, every segment's response in order, so the mask-1 tokens are all the
    engine generated, in order; the reward from :func:`trajectory_reward`; the last segment's
    ``num_turns``, ``extra_fields``, ``multi_modal_data`` and a copy of its ``metrics``. Its
    token sequence is not one any model saw: never train on it.

    Raises:
        ValueError: no segments, or segments holding different rewards.
    """
    reward = trajectory_reward(segments)
    if len(segments) == 1:
        return segments[0]
    last = segments[-1]
    with_lp = all(s.response_logprobs is not None for s in segments)
    return AgentLoopOutput(
        prompt_ids=list(segments[0].prompt_ids),
        response_ids=[t for s in segments for t in s.response_ids],
        response_mask=[m for s in segments for m in s.response_mask],
        response_logprobs=[x for s in segments for x in (s.response_logprobs or [])] if with_lp else None,
        multi_modal_data=last.multi_modal_data,
        reward_score=reward,
        num_turns=last.num_turns,
        metrics=dict(last.metrics),
        extra_fields=last.extra_fields,
    )


__all__ = ["Call", "SegmentBuilder", "trajectory_reward", "trajectory_view"]
