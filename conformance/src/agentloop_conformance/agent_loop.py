"""Agent loop conformance tests: subclass :class:`AgentLoopConformanceTests` and define one
fixture, ``agent_loop_factory``: a callable ``(server) -> AgentLoopBase`` that builds a loop
(with its tokenizer and config) on top of the given engine.

Each check runs the loop's rows against a scripted engine (exact control, non-canonical token
ids like a sampling engine's) and, when the ``real_engine`` fixture gives one, against a real
engine, with a recording proxy between loop and engine. Unless ``scripted_replies`` gives the
model's turns, the scripted engine plays :class:`~agentloop_conformance.turns.TurnScript`: tool
calls (valid, parallel, malformed, to an unknown tool, failing), a truncated turn, user turns
and final answers in the loop's own call format, found by
:func:`~agentloop_conformance.turns.discover_profile`.

A loop may return one output per row or, when its agent rewrote its own context, the list of
the trajectory's segments (see :mod:`agentloop_core.segments`). The token checks then apply
to each segment with the engine calls it holds: segment ``k`` holds the calls from the one whose
prompt is its ``prompt_ids`` up to the next segment's first call.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import pytest

from agentloop_conformance._guard import SuiteGuard
from agentloop_conformance.recording import (
    FailingServer,
    RecordedCall,
    RecordingServer,
    non_canonical_ids,
    scripted_engine,
)
from agentloop_conformance.turns import (
    ALL_KINDS,
    TOOL_KINDS,
    LoopProfile,
    TurnScript,
    classify_text,
    decode_turn,
    discover_profile,
    load_parser,
    probe_failing_arguments,
)
from agentloop_core.loop import AgentLoopBase
from agentloop_core.output import AgentLoopOutput
from agentloop_core.segments import trajectory_reward

ENGINE_KINDS = ("scripted", "real")

DEFAULT_ROWS: tuple[dict[str, Any], ...] = (
    {"raw_prompt": [{"role": "user", "content": "What is 2 + 3?"}]},
    {"raw_prompt": [{"role": "system", "content": "You are terse."},
                    {"role": "user", "content": "Name a fruit. Überraschung 🍎"}]},
)

DEFAULT_REPLIES = ["Let me think. 2 + 3 = 5.", "So the answer is 5.\n#### 5"]
"""What the scripted engine says to a loop that declares no tools (and gets no replies)."""

TURN_KINDS_PROPERTY = "agentloop_turn_kinds"
"""The ``user_properties`` key under which ``test_turn_kinds_exercised`` reports its summary."""


@dataclass
class Rollout:
    """One row rolled out: the loop's outputs and the engine calls it made."""

    outputs: list[AgentLoopOutput]
    """What ``run`` returned: one output, or the trajectory's segments in order."""
    calls: list[RecordedCall]
    """Every ``generate`` call of the row, in order."""
    loop: AgentLoopBase
    """The loop that ran it."""
    kinds: list[str] = field(default_factory=list)
    """The turn kind of each call (see :mod:`agentloop_conformance.turns`)."""
    profile: LoopProfile = field(default_factory=LoopProfile)
    """The loop's tools and call format, as discovered."""
    notes: dict[str, str] = field(default_factory=dict)
    """Turn kinds the script could not play, with why."""

    @property
    def exercised(self) -> set[str]:
        """The kinds the loop went through: a tool-call turn (or a plain turn: a user turn)
        counts when the loop called the engine again after it, a truncated turn when the engine
        stopped it on ``max_tokens``, a final answer when it was the row's last call."""
        out = set()
        for j, kind in enumerate(self.kinds):
            more = j + 1 < len(self.calls)
            if kind == "truncated" or (kind in TOOL_KINDS and more):
                out.add(kind)
            elif kind == "final_answer":
                out.add("user_turn" if more else "final_answer")
        return out

    def segments(self, row: int) -> list[tuple[AgentLoopOutput, range]]:
        """Each output with the indices (in :attr:`calls`) of the engine calls it holds.

        The first segment starts at the first call; segment ``k > 0`` at the last call before
        segment ``k + 1``'s start whose prompt is its ``prompt_ids`` (a call inside a segment has
        a longer prompt than the segment's, so a retried call is not mistaken for one).

        Raises:
            AssertionError: a segment's ``prompt_ids`` is no call's prompt, or the first
                segment does not start at the first call (``row`` names the row).
        """
        starts: list[int] = []
        end = len(self.calls)
        for k in range(len(self.outputs) - 1, -1, -1):
            prompt = self.outputs[k].prompt_ids
            if k == 0:
                start = 0 if self.calls[0].prompt_ids == prompt else None
            else:
                start = next((i for i in range(end - 1, 0, -1) if self.calls[i].prompt_ids == prompt), None)
            where = "the first call's prompt" if k == 0 else f"the prompt of any engine call before call {end}"
            assert start is not None, (
                f"row {row}: segment {k}'s prompt_ids is not {where}; each output's prompt_ids must be the prompt "
                "the engine saw for its first call")
            starts.insert(0, start)
            end = start
        bounds = [*starts[1:], len(self.calls)]
        return [(out, range(a, b)) for out, a, b in zip(self.outputs, starts, bounds, strict=True)]


@dataclass
class LoopSetup:
    """Everything a check needs to roll out the loop on one kind of engine."""

    kind: str
    factory: Callable[[Any], AgentLoopBase]
    rows: list[dict[str, Any]]
    replies: Any
    real_engine: Any


class AgentLoopConformanceTests(SuiteGuard):
    """Mask, log-prob and budget invariants of ``AgentLoopOutput``, and failure handling."""

    __conformance_suite__ = True
    # One event loop per class, so a real engine started in a class-scoped fixture keeps working.
    pytestmark = [pytest.mark.asyncio(loop_scope="class")]

    sampling_params: ClassVar[dict[str, Any]] = {"temperature": 1.0, "max_tokens": 24, "logprobs": True, "seed": 0}
    """Sampling parameters passed to ``run``."""

    @pytest.fixture
    def agent_loop_factory(self) -> Callable[[Any], AgentLoopBase]:
        """Required: a callable ``(server) -> AgentLoopBase`` (tokenizer and config included)."""
        pytest.fail(f"{type(self).__name__} must define an `agent_loop_factory` fixture returning "
                    "a callable (server) -> AgentLoopBase (see the agentloop-conformance README)")

    @pytest.fixture
    def agent_loop_rows(self) -> list[dict[str, Any]]:
        """Dataset rows to roll out (passed to ``run`` as keyword arguments)."""
        return [dict(r) for r in DEFAULT_ROWS]

    @pytest.fixture
    def scripted_replies(self) -> Any:
        """What the scripted engine says on the i-th call of a request (a list of texts, the
        last one repeating, or ``(request_id, prompt_ids, index) -> text``). None (the default):
        the suite scripts the turns itself from the loop's declared tools and call format
        (:class:`~agentloop_conformance.turns.TurnScript`; a loop without tools gets
        :data:`DEFAULT_REPLIES`)."""
        return None

    @pytest.fixture
    def real_engine(self) -> Any:
        """A real engine for the same checks; None skips the ``real`` variants."""
        return None

    @pytest.fixture(params=ENGINE_KINDS)
    def loop_setup(self, request: Any, agent_loop_factory: Any, agent_loop_rows: list, scripted_replies: Any,
                   real_engine: Any) -> LoopSetup:
        if request.param == "real" and real_engine is None:
            pytest.skip("no real engine: override the `real_engine` fixture (or pass --agentloop-engine)")
        return LoopSetup(request.param, agent_loop_factory, agent_loop_rows, scripted_replies, real_engine)

    # -- helpers ------------------------------------------------------------------------------

    probe_tool_errors: ClassVar[bool] = True
    """Whether the suite may run the loop's tools (agentloop ``BaseTool`` objects) on
    candidate arguments to find a call that fails, for the ``tool_error`` turn."""

    async def rollout(self, setup: LoopSetup) -> list[Rollout]:
        """Roll out every row, one fresh loop per row (as the worker does). With the suite's own
        script (``scripted_replies`` None and a loop with tools) the rows repeat until each
        scenario of the script had one."""
        proxy = RecordingServer()
        results = []
        rows = list(setup.rows)
        sampling = dict(self.sampling_params)
        script: TurnScript | None = None
        profile, parser = LoopProfile(), None
        k = 0
        while k < len(rows):
            row = rows[k]
            loop = setup.factory(proxy)
            if proxy.inner is None:
                profile = discover_profile(loop)
                parser = load_parser(profile.tool_parser)
                replies = setup.replies
                if setup.kind == "scripted" and replies is None:
                    replies = DEFAULT_REPLIES
                    if profile.tools and parser is not None:
                        if self.probe_tool_errors and not profile.failing_arguments:
                            await probe_failing_arguments(profile)
                        try:
                            script = replies = TurnScript(profile, loop.tokenizer)
                        except KeyError:  # no writer for this call format
                            replies = DEFAULT_REPLIES
                    if script is not None:
                        rows = [rows[i % len(rows)] for i in range(max(len(rows), len(script.scenarios)))]
                        sampling["max_tokens"] = max(int(sampling.get("max_tokens") or 0), script.max_tokens)
                elif setup.kind == "scripted" and isinstance(replies, (list, tuple)) and replies:
                    # Every given reply fits in one turn (a cut-off call would exercise nothing).
                    longest = max(len(non_canonical_ids(loop.tokenizer, str(t))) for t in replies)
                    sampling["max_tokens"] = max(int(sampling.get("max_tokens") or 0), longest + 8)
                proxy.inner = scripted_engine(loop.tokenizer, replies) if setup.kind == "scripted" \
                    else setup.real_engine
            if script is not None:
                script.row = k
            k += 1
            start = len(proxy.calls)
            out = await loop.run(dict(sampling), **row)
            outputs = out if isinstance(out, list) else [out]
            assert outputs, f"run() returned {type(out).__name__}, not an AgentLoopOutput or a non-empty list of them"
            assert all(isinstance(o, AgentLoopOutput) for o in outputs), f"run() returned {type(out).__name__}, not an AgentLoopOutput or a non-empty list of them"
            calls = proxy.calls[start:]
            assert calls, "the loop returned without calling generate"
            kinds = self._turn_kinds(calls, loop.tokenizer, parser, profile, script)
            results.append(Rollout(outputs, calls, loop, kinds, profile, dict(script.skipped) if script else {}))
        return results

    @staticmethod
    def _turn_kinds(calls: list[RecordedCall], tokenizer: Any, parser: Any, profile: LoopProfile,
                    script: TurnScript | None) -> list[str]:
        """Each call's turn kind: ``truncated`` when the engine stopped on max_tokens, else the
        script's label, else what the loop's parser reads in the output."""
        kinds, seen = [], {}
        for c in calls:
            index = seen[c.request_id] = seen.get(c.request_id, -1) + 1
            label = script.labels.get((c.request_id, index)) if script is not None else None
            if c.output.stop_reason == "length":
                label = "truncated"
            elif label is None or label == "truncated":
                label = classify_text(decode_turn(tokenizer, c.output.token_ids, parser), parser, profile.tools)
            kinds.append(label)
        return kinds

    # -- checks -------------------------------------------------------------------------------

    async def test_mask_one_tokens_are_the_engine_output(self, loop_setup: LoopSetup) -> None:
        """The tokens with response_mask 1 are exactly the ids the engine returned, call after
        call, in order (over the segments in order, when the loop returned several), and each
        output's prompt_ids is the prompt of its first call (the first output's: the first
        call's). Debug: a loop that decodes generated text and re-encodes it (the one law:
        never) fails here on the scripted engine, which returns non-canonical ids as real
        samplers do; a segment whose tokens differ from its calls' is named."""
        for k, r in enumerate(await self.rollout(loop_setup)):
            generated = [t for c in r.calls for t in c.output.token_ids]
            kept = [t for out in r.outputs for t, m in zip(out.response_ids, out.response_mask, strict=True) if m == 1]
            assert kept == generated, (
                f"row {k}: mask-1 tokens differ from the engine's output:\n  engine: {generated[:40]}\n"
                f"  mask-1: {kept[:40]}")
            for s, (out, calls) in enumerate(r.segments(k)):
                own = [t for t, m in zip(out.response_ids, out.response_mask, strict=True) if m == 1]
                assert own == [t for j in calls for t in r.calls[j].output.token_ids], (
                    f"row {k}: segment {s}'s mask-1 tokens are not the output of its calls {calls.start}.."
                    f"{calls.stop - 1}")

    async def test_log_probs_aligned_with_mask(self, loop_setup: LoopSetup) -> None:
        """response_logprobs holds the engine's log-prob of each mask-1 token, in order (over
        the segments in order), and 0.0 on mask-0 tokens. Debug: log-probs appended for tool
        tokens, or dropped for a turn or a segment."""
        for k, r in enumerate(await self.rollout(loop_setup)):
            engine_lps = [lp for c in r.calls for lp in (c.output.log_probs or [])]
            if not engine_lps:
                pytest.skip("the engine returned no log-probs")
            kept: list[float] = []
            for s, out in enumerate(r.outputs):
                assert out.response_logprobs is not None, (
                    f"row {k}: segment {s}: the engine returned log-probs but the loop dropped them")
                kept += [lp for lp, m in zip(out.response_logprobs, out.response_mask, strict=True) if m == 1]
                other = [lp for lp, m in zip(out.response_logprobs, out.response_mask, strict=True) if m == 0]
                assert all(lp == 0.0 for lp in other), f"row {k}: segment {s}: mask-0 tokens carry non-zero log-probs"
            assert kept == pytest.approx(engine_lps, abs=1e-6), f"row {k}: mask-1 log-probs are not the engine's"

    async def test_no_tool_or_user_token_has_mask_one(self, loop_setup: LoopSetup) -> None:
        """Every generate call's prompt is a prefix of its segment's final sequence and the
        engine's ids follow it there; response_mask is 1 on those ids and 0 on everything the
        loop added (tool results, user turns, template glue). Debug: compare the expected and
        actual mask around the first difference."""
        for k, r in enumerate(await self.rollout(loop_setup)):
            for s, (out, calls) in enumerate(r.segments(k)):
                where = f"row {k}" + (f" segment {s}" if len(r.outputs) > 1 else "")
                full = out.prompt_ids + out.response_ids
                n_prompt = len(out.prompt_ids)
                expected = [0] * len(out.response_ids)
                for j in calls:
                    c = r.calls[j]
                    start, ids = len(c.prompt_ids), c.output.token_ids
                    assert full[:start] == c.prompt_ids, f"{where}: call {j}'s prompt is not a prefix of the final ids"
                    assert full[start : start + len(ids)] == ids, f"{where}: call {j}'s output is not where it was generated"
                    for i in range(start - n_prompt, start - n_prompt + len(ids)):
                        expected[i] = 1
                if out.response_mask != expected:
                    i = next(i for i, (a, b) in enumerate(zip(out.response_mask, expected, strict=True)) if a != b)
                    pytest.fail(f"{where}: response_mask differs from the generated positions at response index {i}: "
                                f"mask {out.response_mask[max(0, i - 5) : i + 5]} expected "
                                f"{expected[max(0, i - 5) : i + 5]}")

    async def test_response_length_within_budget(self, loop_setup: LoopSetup) -> None:
        """len(response_ids) never exceeds the loop's ``response_length`` config (a field of
        its typed config, or a key of its dict config), for each segment (each is one training
        row of that width). Debug: a tool result or user turn appended past the budget."""
        for k, r in enumerate(await self.rollout(loop_setup)):
            config = r.loop.config
            budget = config.get("response_length") if isinstance(config, Mapping) else getattr(
                config, "response_length", None)
            if budget is None:
                pytest.skip("the loop's config has no response_length")
            for s, out in enumerate(r.outputs):
                assert len(out.response_ids) <= int(budget), (
                    f"row {k} segment {s}: {len(out.response_ids)} response tokens, budget {budget}")

    async def test_tool_results_reach_the_model(self, loop_setup: LoopSetup) -> None:
        """After a turn that calls a tool (valid, parallel, malformed, unknown or failing), the
        loop's next engine call sees something answering it: between that turn's ids and the
        next generation the loop added text beyond the chat template's generation prompt (the
        tool results, or error messages for calls it could not run). Debug: a loop that drops a
        tool result (or every error message for a bad call) lets the model generate as if the
        call had never been answered."""
        answered = 0
        for k, r in enumerate(await self.rollout(loop_setup)):
            header = _generation_prompt_text(r.loop.tokenizer)
            for j, kind in enumerate(r.kinds[:-1]):
                c, nxt = r.calls[j], r.calls[j + 1]
                done = c.prompt_ids + list(c.output.token_ids)
                if kind not in TOOL_KINDS or nxt.prompt_ids[: len(done)] != done:
                    continue  # not a tool turn, or the next call starts a new segment
                added = r.loop.tokenizer.decode(nxt.prompt_ids[len(done):], skip_special_tokens=True)
                rest = added.strip()
                if header and rest.endswith(header):
                    rest = rest[: -len(header)].strip()
                assert rest, (f"row {k}: call {j} was a {kind} turn, but the loop's next engine call adds nothing "
                              f"answering it (added text {added!r}): a tool result or error message was dropped")
                answered += 1
        if not answered:
            pytest.skip("no tool-call turn was followed by another engine call")

    async def test_turn_kinds_exercised(self, request: Any, agent_loop_factory: Any, agent_loop_rows: list,
                                        scripted_replies: Any) -> None:
        """Records which kinds of turn the scripted rollout drove the loop through (shown by
        ``agentloop-conformance --loop`` and in pytest's terminal summary). A loop that declares
        tools but went through no tool-call turn fails: the other checks then only ever saw
        generated tokens. Debug: give replies that call the loop's tools (override the
        ``scripted_replies`` fixture, or ``--agentloop-replies=FILE.json`` in no-code mode), or
        declare the call format (``conformance_profile()``, see
        :mod:`agentloop_conformance.turns`)."""
        setup = LoopSetup("scripted", agent_loop_factory, agent_loop_rows, scripted_replies, None)
        rollouts = await self.rollout(setup)
        summary = turn_kinds_summary(rollouts)
        request.node.user_properties.append((TURN_KINDS_PROPERTY, summary))
        profile = rollouts[0].profile
        exercised = set().union(*(r.exercised for r in rollouts))
        if profile.tools and not exercised & set(TOOL_KINDS):
            pytest.fail(f"the loop declares tools {sorted(profile.tools)} (call format {profile.tool_parser!r}) but "
                        "no tool-call turn was exercised: give replies that call them (override the "
                        "`scripted_replies` fixture, or pass --agentloop-replies=FILE.json in no-code mode), or "
                        "declare the call format with conformance_profile(). " + summary)

    async def test_segments_are_numbered_and_share_one_reward(self, loop_setup: LoopSetup) -> None:
        """A row returned as several outputs is one trajectory's segments: their
        ``segment_index`` is 0, 1, ... in order (or left 0 everywhere for the worker to number),
        they share one ``reward_score`` (earlier ones may leave it None) and none is a failure
        (a failed trajectory is one failed output). Debug: build them with ``SegmentBuilder.outputs(reward_score=...)``, which
        sets all of this."""
        rollouts = await self.rollout(loop_setup)
        if all(len(r.outputs) == 1 for r in rollouts):
            pytest.skip("the loop returned one output per row: no segments to check")
        for k, r in enumerate(rollouts):
            n = len(r.outputs)
            indices = [o.segment_index for o in r.outputs]
            assert indices in (list(range(n)), [0] * n), f"row {k}: segment indices {indices}, expected 0..{n - 1}"
            try:
                trajectory_reward(r.outputs)
            except ValueError as exc:
                pytest.fail(f"row {k}: {exc}")
            if n > 1:
                failed = [s for s, o in enumerate(r.outputs) if o.failed]
                assert not failed, f"row {k}: segments {failed} are failures; a failed trajectory is one output"

    async def test_failures_become_failed_samples(self, agent_loop_factory: Any, agent_loop_rows: list) -> None:
        """When the engine raises, AgentLoopWorker returns one failed sample per row
        (``metrics["failed"]``, the error text kept), never an exception that kills the batch
        and never a silently empty success. Debug: a loop that catches engine errors and
        returns a normal output hides them from the trainer; let them propagate."""
        from agentloop_core.registry import register
        from agentloop_core.runtime import AgentLoopWorker

        server = FailingServer()
        tokenizer = agent_loop_factory(server).tokenizer
        name = f"agentloop-conformance-{uuid.uuid4().hex[:12]}"

        @register(name)
        class _Adapter(AgentLoopBase):
            async def run(self, sampling_params: Any, **row: Any) -> AgentLoopOutput:
                return await agent_loop_factory(self.server).run(sampling_params, **row)

        worker = AgentLoopWorker(server, tokenizer, {"default_agent_loop": name,
                                                     "sampling_params": dict(self.sampling_params)})
        outs = await worker.generate_sequences([dict(r) for r in agent_loop_rows])
        assert len(outs) == len(agent_loop_rows)
        for k, out in enumerate(outs):
            assert out.failed, f"row {k}: the engine failed but the sample is not marked failed: {out.metrics}"
            assert "injected engine failure" in str(out.metrics.get("error")), f"row {k}: error text lost"


def _generation_prompt_text(tokenizer: Any) -> str:
    """The chat template's generation prompt as decoded without special tokens
    (``assistant``), or "" when it cannot be rendered."""
    try:
        probe = [{"role": "user", "content": "x"}]
        with_prompt = tokenizer.apply_chat_template(probe, add_generation_prompt=True, tokenize=True)
        without = tokenizer.apply_chat_template(probe, add_generation_prompt=False, tokenize=True)
    except Exception:  # noqa: BLE001 - no template: compare with nothing
        return ""
    if hasattr(with_prompt, "keys"):
        with_prompt, without = with_prompt["input_ids"], without["input_ids"]
    if list(with_prompt[: len(without)]) != list(without):
        return ""
    return tokenizer.decode(list(with_prompt[len(without):]), skip_special_tokens=True).strip()


def turn_kinds_summary(rollouts: list[Rollout]) -> str:
    """One line: the loop's tools and call format, the turn kinds exercised and those not."""
    profile = rollouts[0].profile
    exercised = set().union(*(r.exercised for r in rollouts))
    notes: dict[str, str] = {}
    for r in rollouts:
        notes.update(r.notes)
    head = (f"tools {', '.join(sorted(profile.tools))} ({profile.tool_parser})" if profile.tools
            else "no tools declared")
    done = [k for k in ALL_KINDS if k in exercised]
    missing = [f"{k} ({notes[k]})" if k in notes else k for k in ALL_KINDS if k not in exercised]
    return f"{head}; exercised: {', '.join(done) or 'none'}; not exercised: {', '.join(missing) or 'none'}"
