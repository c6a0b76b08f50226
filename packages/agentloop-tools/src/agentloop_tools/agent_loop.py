"""The multi-turn tool agent loop, registered as ``tool_agent``.

Each trajectory moves through PENDING -> GENERATING -> PROCESSING_TOOLS -> (INTERACTING) ->
TERMINATED. The model's tokens are appended exactly as the engine returned them (mask 1); tool
results and user replies are rendered with the chat template and appended as the delta between
the template applied to the history and to history + new messages (mask 0). Generated text is
decoded only to find tool calls, never re-encoded for training.

Each call the model makes is answered by one tool message carrying the function's ``name`` and
a ``tool_call_id``: the id the model wrote when its format has one the template accepts
(Mistral), else one the parser makes (:meth:`~agentloop_core.parsers.ToolParser.make_call_id`).
The turn's calls are attached to the trajectory in OpenAI form with the same ids, so templates
that render a tool result only after the call it answers (gpt-oss, Mistral) can render it.

With a reasoning parser (``reasoning_parser``), the tool parser reads only a turn's content:
calls the model drafts inside its reasoning are counted, not run (``tool_calls_in_reasoning``
runs them too). The split chooses what runs; the trajectory keeps every generated token.

Anything a tool does wrong (raises, hangs, returns junk, gets bad arguments, does not exist)
becomes an error message the model reads on its next turn and a counter in ``metrics``; it
never ends the trajectory with an exception. A misconfigured row is different: ``tools_kwargs``
that a tool cannot take (:class:`~agentloop_tools.base.ToolKwargsError`), or naming a tool or an
interaction the loop does not have, fails the sample with the error.
"""

from __future__ import annotations

import asyncio
import enum
import json
import logging
import math
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from agentloop_core.loop import AgentLoopBase
from agentloop_core.output import AgentLoopOutput
from agentloop_core.parsers import ParseResult, ToolCall, get_tool_parser
from agentloop_core.protocol import SamplingParams, TokenOutput
from agentloop_core.reasoning import PROMPT_TAIL_TOKENS, ReasoningParser, get_reasoning_parser
from agentloop_core.registry import register
from agentloop_core.runtime.pacing import turn_slot
from agentloop_core.stops import StopCounter
from agentloop_tools.base import ToolKwargsError, create_instances
from agentloop_tools.interaction import BaseInteraction, select_interaction
from agentloop_tools.loop_config import ToolAgentConfig, resolve_interactions, resolve_tools
from agentloop_tools.per_tokenizer import check_template_renders_tools, stop_token_ids
from agentloop_tools.rows import row_messages, row_tools_kwargs
from agentloop_tools.schema import ToolResponse
from agentloop_tools.truncation import cut_tool_response

logger = logging.getLogger(__name__)

REASONING_COUNTERS = ("reasoning_turns", "reasoning_chars", "reasoning_unclosed", "tool_calls_in_reasoning",
                      "tool_calls_in_reasoning_ignored")
"""Metrics of a loop with a reasoning parser: turns with reasoning, its characters, turns that
ended inside it, calls (usable or not) written inside it, and those of them not run."""


class AgentState(enum.Enum):
    """Where a trajectory is in the tool agent loop."""

    PENDING = "pending"
    GENERATING = "generating"
    PROCESSING_TOOLS = "processing_tools"
    INTERACTING = "interacting"
    TERMINATED = "terminated"


@dataclass
class _Run:
    """Per-trajectory bookkeeping."""

    request_id: str
    interaction: BaseInteraction | None = None
    """The interaction this row picked (see ``select_interaction``), or None."""
    interaction_id: str | None = None
    instances: dict[str, str] = field(default_factory=dict)
    create_errors: dict[str, str] = field(default_factory=dict)
    assistant_turns: int = 0
    user_turns: int = 0
    tool_rewards: list[float] = field(default_factory=list)
    turn_scores: list[float] = field(default_factory=list)
    counters: dict[str, float] = field(default_factory=lambda: dict.fromkeys(
        ("tool_calls", "tool_errors", "parse_errors", "tool_calls_over_limit", "tool_media_dropped", "dropped_message_tokens",
         "tool_responses_truncated_length", "tool_responses_truncated_tokens",
         "generate_s", "tool_calls_s", "interaction_s"), 0))
    termination: str = ""
    ended_with_eos: bool = True
    """Whether the last generated turn ended on a stop token (``ChatRenderer.ended_turn``)."""
    call_ids: list[str] = field(default_factory=list)
    """Ids of the last turn's calls: its usable calls, then the calls the parser could not use."""
    reported: list[dict[str, Any]] = field(default_factory=list)
    """Every metrics dict a tool call or the interaction returned, as returned."""
    stops: StopCounter = field(default_factory=StopCounter)
    """Which limits stopped its turns (turn cap, response budget, context)."""
    starts_in_reasoning: bool = False
    """Whether the turn being generated begins inside reasoning (the prompt opened it)."""
    turn_text: tuple[str, str, str | None] = ("", "", None)
    """The last turn as the parsers read it: ``(text, content, reasoning)`` (content is the
    text, reasoning None, without a reasoning parser)."""

    def add_metrics(self, source: str, turn: int, metrics: Any) -> None:
        """Keep a tool's or the interaction's metrics: numbers (bools count 1/0) add up over the
        trajectory into ``counters["<source>/<key>"]``; the whole dict, numbers or not, goes
        to ``extra_fields["reported_metrics"]``."""
        if metrics is None:
            return
        if not isinstance(metrics, Mapping):
            self.counters["invalid_metrics"] = self.counters.get("invalid_metrics", 0) + 1
            logger.warning("%s returned metrics of type %s; metrics must be a dict (kept as text)",
                           source, type(metrics).__name__)
            metrics = {"invalid": repr(metrics)[:200]}
        if not metrics:
            return
        self.reported.append({"source": source, "turn": turn, "metrics": dict(metrics)})
        for key, value in metrics.items():
            if isinstance(value, (bool, int, float)) and math.isfinite(value):
                name = f"{source}/{key}"
                self.counters[name] = self.counters.get(name, 0) + float(value)


@register("tool_agent")
class ToolAgentLoop(AgentLoopBase):
    """Generates, runs the tools the model calls, feeds results back, repeats.

    Config: a :class:`ToolAgentConfig` (or a mapping read into one): its tools (``tools`` /
    ``tool_config_path`` / ``function_tool_path``, see :func:`resolve_tools`) and interactions
    (``interaction`` or ``interaction_config_path``, see :func:`resolve_interactions`) included.

    Row keys: ``raw_prompt`` (chat messages), ``tools_kwargs`` (per tool name: ``create_kwargs``
    go to ``create``, ``execute_kwargs`` / ``calc_reward_kwargs`` / ``release_kwargs`` to those
    methods, see :mod:`agentloop_tools.base`), ``interaction_kwargs`` (passed whole to
    ``Interaction.start``; its ``name`` picks the interaction when several are configured),
    ``request_id`` (optional; one id for all turns keeps them on one replica's prefix cache).
    """

    config_class: ClassVar[type] = ToolAgentConfig
    """This loop's typed config, built once per rollout (``RolloutConfig.with_loop_configs``)."""

    def __init__(self, server: Any, tokenizer: Any, config: ToolAgentConfig | Mapping[str, Any] | None = None,
                 processor: Any = None, tracer: Any = None) -> None:
        super().__init__(server, tokenizer, config, processor, tracer)
        self.settings: ToolAgentConfig
        self.tools = resolve_tools(self.settings)
        self._init_parsers()
        self.interactions: dict[str, BaseInteraction] = resolve_interactions(self.settings)
        schemas = [tool.tool_schema.model_dump(exclude_none=True) for tool in self.tools.values()]
        self.renderer = self._make_renderer(schemas)
        if schemas:
            check_template_renders_tools(self.renderer, sorted(self.tools))

    def _init_parsers(self) -> None:
        """The tool parser, the reasoning parser (checked against it) and the stop token ids."""
        self.parser = get_tool_parser(self.settings.tool_parser)
        self.reasoning_parser: ReasoningParser | None = None
        if self.settings.reasoning_parser is not None:
            self.reasoning_parser = get_reasoning_parser(self.settings.reasoning_parser)
            if self.reasoning_parser.needs_special_tokens and not self.parser.needs_special_tokens:
                raise ValueError(
                    f"reasoning_parser {self.settings.reasoning_parser!r} reads special tokens that tool_parser "
                    f"{self.settings.tool_parser!r} has decoded away; use the tool parser of the same family "
                    "(multi_turn.tool_parser: gpt_oss)")
        self.stop_token_ids = stop_token_ids(self.tokenizer, self.parser.stop_tokens)

    def _make_renderer(self, schemas: list[dict[str, Any]]) -> Any:
        """The chat renderer of this loop's trajectories, with ``schemas`` as ``tools=``."""
        from agentloop_core.tokenization import ChatRenderer

        return ChatRenderer(
            self.tokenizer, tools=schemas or None,
            use_inference_chat_template=self.settings.use_inference_chat_template,
            apply_chat_template_kwargs=dict(self.settings.apply_chat_template_kwargs),
            delta_strategy=self.settings.delta_strategy,
        )

    async def run(self, sampling_params: Mapping[str, Any] | SamplingParams, **row: Any) -> AgentLoopOutput:
        """Roll out one trajectory; see the class docstring for the row keys.

        Raises:
            ValueError: the row is malformed (no ``raw_prompt``, ``tools_kwargs`` for an unknown
                tool, ``interaction_kwargs`` naming an unknown interaction) or the prompt is
                longer than ``prompt_length``.
            ToolKwargsError: a tool cannot take the row's ``tools_kwargs``.
        """
        messages = row_messages(row, "tool_agent")
        tools_kwargs = row_tools_kwargs(row, self.tools)
        base, per_turn_cap = self._sampling(sampling_params)
        trajectory = self._new_trajectory(messages)
        interaction_kwargs = dict(row.get("interaction_kwargs") or {})
        run = _Run(request_id=str(row.get("request_id") or uuid.uuid4().hex),
                   interaction=select_interaction(self.interactions, interaction_kwargs))
        if self.reasoning_parser is not None:
            run.counters.update(dict.fromkeys(REASONING_COUNTERS, 0))
        try:
            await self._create_instances(run, tools_kwargs)
            if run.interaction is not None:
                run.interaction_id = await run.interaction.start(None, **interaction_kwargs)
            await self._loop(run, trajectory, base, per_turn_cap)
            reward = await self._reward(run)
        finally:
            await self._release(run)
        return self._output(run, trajectory, reward, {"turn_scores": list(run.turn_scores),
                                                      "tool_rewards": list(run.tool_rewards)})

    def _sampling(self, sampling_params: Mapping[str, Any] | SamplingParams) -> tuple[SamplingParams, int | None]:
        """The sampling of every turn (the tool parser's stop tokens added) and the per-turn cap
        (None: a mapping without ``max_tokens``, each turn may use what is left of the budget)."""
        base = SamplingParams.from_mapping(sampling_params)
        per_turn_cap = base.max_tokens if not isinstance(sampling_params, Mapping) or "max_tokens" in sampling_params else None
        return base.replace(stop_token_ids=tuple(dict.fromkeys(base.stop_token_ids + self.stop_token_ids))), per_turn_cap

    def _new_trajectory(self, messages: Any) -> Any:
        """The trajectory of ``messages`` rendered as the prompt.

        Raises:
            ValueError: the prompt is longer than ``prompt_length``.
        """
        from agentloop_core.tokenization import Trajectory

        trajectory = Trajectory(self.renderer, list(messages), sanity_check=self.settings.sanity_check)
        limit = self.settings.prompt_length
        if limit is not None and len(trajectory.prompt_ids) > limit:
            raise ValueError(f"rendered prompt has {len(trajectory.prompt_ids)} tokens, more than "
                             f"prompt_length={limit}; raise prompt_length or filter long prompts")
        return trajectory

    def _output(self, run: _Run, trajectory: Any, reward: float | None, extra: dict[str, Any]) -> AgentLoopOutput:
        """The trajectory as an output with the run's metrics and ``extra`` over the common fields."""
        metrics = {**run.counters, **run.stops.metrics(), "assistant_turns": run.assistant_turns,
                   "user_turns": run.user_turns, "turns": run.assistant_turns + run.user_turns}
        extra = {"messages": list(trajectory.messages), "termination_reason": run.termination,
                 "request_id": run.request_id, "reported_metrics": list(run.reported), **extra}
        return trajectory.to_output(reward_score=reward, metrics=metrics, extra_fields=extra,
                                    sanity_check=self.settings.sanity_check)

    async def _loop(self, run: _Run, trajectory: Any, base: SamplingParams, per_turn_cap: int | None) -> None:
        cfg = self.settings
        state = AgentState.GENERATING
        parsed: ParseResult | None = None
        while state is not AgentState.TERMINATED:
            if state is AgentState.GENERATING:
                remaining = cfg.response_length - len(trajectory.response_ids)
                if remaining < 1:
                    run.termination = "response_length"
                    break
                max_tokens = remaining if per_turn_cap is None else min(per_turn_cap, remaining)
                if self.reasoning_parser is not None and self.reasoning_parser.reads_prompt:
                    tail = self.tokenizer.decode(trajectory.context_ids[-PROMPT_TAIL_TOKENS:], skip_special_tokens=False)
                    run.starts_in_reasoning = self.reasoning_parser.starts_in_reasoning(tail)
                start = time.perf_counter()
                with self.tracer.span("generate", turn=run.assistant_turns, request_id=run.request_id):
                    out: TokenOutput = await self.server.generate(
                        run.request_id, trajectory.context_ids, base.replace(max_tokens=max_tokens))
                run.counters["generate_s"] += time.perf_counter() - start
                run.stops.add(out.stop_reason, len(out.token_ids), max_tokens, per_turn_cap)
                trajectory.append_generated(out)
                run.assistant_turns += 1
                run.ended_with_eos = self.renderer.ended_turn(out.token_ids, out.stop_reason)
                state, parsed = self._after_generate(run, trajectory, out)
            elif state is AgentState.PROCESSING_TOOLS:
                assert parsed is not None
                tool_messages = await self._run_tools(run, parsed)
                state = self._append(run, trajectory, tool_messages)
            elif state is AgentState.INTERACTING:
                state = await self._interact(run, trajectory)
        if run.termination == "response_length" or len(trajectory.response_ids) >= cfg.response_length:
            run.stops.response_budget = True

    def _after_generate(self, run: _Run, trajectory: Any, out: TokenOutput) -> tuple[AgentState, ParseResult | None]:
        cfg = self.settings
        if out.stop_reason == "aborted":
            run.termination = "aborted"
            return AgentState.TERMINATED, None
        if out.stop_reason == "length":
            # A turn cut by the budget may hold half a call; running it would act on a guess.
            run.termination = "length"
            return AgentState.TERMINATED, None
        if len(trajectory.response_ids) >= cfg.response_length:
            run.termination = "response_length"
            return AgentState.TERMINATED, None
        if self.parser.needs_special_tokens:
            # Harmony/Mistral call markup is special tokens; the assistant message holds this
            # turn decoded with them kept and the token that ended the turn removed. The parser
            # gets that token back when it is one of its own stop tokens (harmony's <|call|>
            # closes the call).
            text = trajectory.messages[-1]["content"]
            if run.ended_with_eos and out.token_ids[-1] in self.stop_token_ids:
                text += self.renderer.decode(out.token_ids[-1:])
        else:
            text = self.tokenizer.decode(out.token_ids, skip_special_tokens=True)
        parsed = self._parse_turn(run, text)
        run.counters["parse_errors"] += len(parsed.errors)
        if cfg.max_assistant_turns is not None and run.assistant_turns >= cfg.max_assistant_turns:
            run.termination = "max_assistant_turns"
            return AgentState.TERMINATED, None
        return self._next_state(run, trajectory, parsed)

    def _next_state(self, run: _Run, trajectory: Any, parsed: ParseResult) -> tuple[AgentState, ParseResult | None]:
        """Where a turn that may go on leads: its calls run, else the interaction, else the end."""
        if parsed.attempted:
            self._attach_calls(run, trajectory, parsed)
            return AgentState.PROCESSING_TOOLS, parsed
        if run.interaction is not None:
            return AgentState.INTERACTING, None
        run.termination = "no_tool_call"
        return AgentState.TERMINATED, None

    def _parse_turn(self, run: _Run, text: str) -> ParseResult:
        """The turn's calls: from its content when a reasoning parser splits it (counting the
        calls drafted in the reasoning), else from all of it."""
        run.turn_text = (text, text, None)
        if self.reasoning_parser is None:
            return self.parser.parse(text, self.tools)
        split = self.reasoning_parser.split(text, in_reasoning=run.starts_in_reasoning)
        run.turn_text = (text, split.content, split.reasoning if split.has_reasoning else None)
        drafted = 0
        if split.has_reasoning:
            run.counters["reasoning_turns"] += 1
            run.counters["reasoning_chars"] += len(split.reasoning)
            # Parsed only to count; record=False keeps the parser's counters one per turn.
            inner = self.parser.parse(split.reasoning, self.tools, record=False)
            drafted = len(inner.calls) + len(inner.errors)
        run.counters["reasoning_unclosed"] += not split.closed
        run.counters["tool_calls_in_reasoning"] += drafted
        if self.settings.tool_calls_in_reasoning:
            return self.parser.parse(text, self.tools)
        run.counters["tool_calls_in_reasoning_ignored"] += drafted
        return self.parser.parse(split.content, self.tools)

    def _attach_calls(self, run: _Run, trajectory: Any, parsed: ParseResult) -> None:
        """Give every call of the turn (usable or not; each gets a tool message) its id, and
        attach the calls to the turn in OpenAI form, so templates that render a tool result
        only after the call it answers (gpt-oss, Mistral) can render the tool messages."""
        turn = run.assistant_turns
        run.call_ids = [call.model_id or self.parser.make_call_id(turn, i, call)
                        for i, call in enumerate(parsed.calls)]
        run.call_ids += [self.parser.make_call_id(turn, len(parsed.calls) + i) for i in range(len(parsed.errors))]
        functions = [{"name": call.name, "arguments": json.dumps(call.arguments, ensure_ascii=False)}
                     for call in parsed.calls]
        functions += [{"name": error.name or "", "arguments": error.raw} for error in parsed.errors]
        calls = [{"id": call_id, "type": "function", "function": function}
                 for call_id, function in zip(run.call_ids, functions, strict=True)]
        trajectory.attach_tool_calls(calls)

    def _append(self, run: _Run, trajectory: Any, new_messages: list[dict[str, Any]]) -> AgentState:
        """Append tool or user messages unless they would leave no room to generate."""
        delta = trajectory.preview_messages(new_messages)  # append_messages reuses it
        if len(trajectory.response_ids) + len(delta) >= self.settings.response_length:
            # Truncating the delta would cut the template mid-turn; dropping it ends cleanly.
            run.termination = "response_length"
            run.counters["dropped_message_tokens"] = len(delta)
            return AgentState.TERMINATED
        trajectory.append_messages(new_messages)
        return AgentState.GENERATING

    async def _interact(self, run: _Run, trajectory: Any) -> AgentState:
        assert run.interaction is not None
        assert run.interaction_id is not None
        limit = self.settings.max_user_turns
        if limit is not None and run.user_turns >= limit:
            run.termination = "max_user_turns"
            return AgentState.TERMINATED
        start = time.perf_counter()
        with self.tracer.span("interaction", turn=run.user_turns, request_id=run.request_id):
            done, text, score, metrics = await run.interaction.generate_response(
                run.interaction_id, list(trajectory.messages))
        run.counters["interaction_s"] += time.perf_counter() - start
        await turn_slot()
        run.add_metrics("interaction", run.user_turns, metrics)
        run.turn_scores.append(float(score))
        if done:
            run.termination = "interaction"
            return AgentState.TERMINATED
        run.user_turns += 1
        return self._append(run, trajectory, [{"role": "user", "content": str(text)}])

    # --- tools ---------------------------------------------------------------------------------

    async def _create_instances(self, run: _Run, tools_kwargs: dict[str, Any]) -> None:
        misconfigured: list[ToolKwargsError] = []
        for name, result in (await create_instances(self.tools, tools_kwargs)).items():
            if isinstance(result, ToolKwargsError):
                misconfigured.append(result)
            elif isinstance(result, Exception):  # the model gets an error when it calls this tool
                run.create_errors[name] = f"{type(result).__name__}: {result}"
                logger.warning("tool %r create failed for request %s: %s", name, run.request_id, run.create_errors[name])
            else:
                run.instances[name] = result
        if misconfigured:  # run() releases the instances that were created
            raise misconfigured[0]

    async def _run_tools(self, run: _Run, parsed: ParseResult) -> list[dict[str, Any]]:
        limit = self.settings.max_parallel_calls
        ids = iter(run.call_ids)  # one per call, then one per error (see _attach_calls)
        start = time.perf_counter()
        results = await asyncio.gather(*(self._call_tool(run, call) for call in parsed.calls[:limit]))
        run.counters["tool_calls_s"] += time.perf_counter() - start
        await turn_slot()  # tool calls end in bursts (a thread pool's whole switch interval at once)
        messages = []
        for call, text in zip(parsed.calls[:limit], results, strict=True):
            messages.append(self._tool_message(run, call.name, next(ids), text))
        for call in parsed.calls[limit:]:
            run.counters["tool_errors"] += 1
            run.counters["tool_calls_over_limit"] += 1
            messages.append(self._tool_message(run, call.name, next(ids),
                                               f"Error: too many tool calls in one turn (limit {limit}); "
                                               f"this call to {call.name!r} was not run. Call it again next turn."))
        for error in parsed.errors:
            messages.append(self._tool_message(run, error.name or "", next(ids), f"Error: {error.reason}"))
        return messages

    def _tool_message(self, run: _Run, name: str, call_id: str, text: str) -> dict[str, Any]:
        cfg = self.settings
        cut = cut_tool_response(text, cfg.tool_response_truncate_side, max_length=cfg.max_tool_response_length,
                                max_tokens=cfg.max_tool_response_tokens, tokenizer=self.tokenizer)
        # Which limit cut it, so a run can see whether its tools' output is being lost.
        run.counters["tool_responses_truncated_length"] += cut.by_length
        run.counters["tool_responses_truncated_tokens"] += cut.by_tokens
        return {"role": "tool", "name": name, "tool_call_id": call_id, "content": cut.text}

    async def _call_tool(self, run: _Run, call: ToolCall) -> str:
        """Run one call; every failure becomes error text for the model."""
        tool = self.tools.get(call.name)
        run.counters["tool_calls"] += 1
        if tool is None or call.name not in run.instances:
            run.counters["tool_errors"] += 1
            why = run.create_errors.get(call.name, "no such tool")
            return f"Error: tool {call.name!r} is unavailable ({why})."
        timeout = tool.timeout_s if tool.timeout_s is not None else self.settings.tool_timeout_s
        with self.tracer.span(f"tool:{call.name}", request_id=run.request_id) as span:
            try:
                result = await asyncio.wait_for(tool.run_execute(run.instances[call.name], dict(call.arguments)), timeout)
            except asyncio.TimeoutError:
                run.counters["tool_errors"] += 1
                span["tool_error"] = "timeout"
                return f"Error: tool {call.name!r} timed out after {timeout:g} s."
            except Exception as exc:  # noqa: BLE001 - a tool bug must not end the trajectory
                run.counters["tool_errors"] += 1
                span["tool_error"] = type(exc).__name__
                return f"Error: tool {call.name!r} failed: {type(exc).__name__}: {exc}"
        if not (isinstance(result, tuple) and len(result) == 3 and isinstance(result[0], ToolResponse)):
            run.counters["tool_errors"] += 1
            logger.warning("tool %r returned %s; execute must return (ToolResponse, reward, metrics)",
                           call.name, type(result).__name__)
            return f"Error: tool {call.name!r} returned an invalid result."
        response, reward, metrics = result
        run.add_metrics(f"tool/{call.name}", run.assistant_turns, metrics)
        try:
            run.tool_rewards.append(float(reward or 0.0))
        except (TypeError, ValueError):
            run.counters["tool_errors"] += 1
            run.tool_rewards.append(0.0)
        text = response.text or ""
        if response.image or response.video:
            # This loop renders text only; say so instead of silently losing the media.
            run.counters["tool_media_dropped"] += len(response.image or []) + len(response.video or [])
            text += "\n[the tool returned images or videos, which this loop cannot show]"
        return text

    async def _reward(self, run: _Run) -> float | None:
        if self.settings.tool_reward == "none":
            return None
        total = sum(run.tool_rewards)
        with self.tracer.span("reward", request_id=run.request_id):
            for name, iid in run.instances.items():
                try:
                    total += float(await self.tools[name].run_calc_reward(iid))
                except Exception as exc:  # noqa: BLE001
                    run.counters["tool_errors"] += 1
                    logger.warning("tool %r calc_reward failed: %s: %s", name, type(exc).__name__, exc)
            if run.interaction is not None and run.interaction_id is not None:
                total += float(await run.interaction.calculate_score(run.interaction_id))
        return total

    async def _release(self, run: _Run) -> None:
        for name, iid in run.instances.items():
            try:
                await self.tools[name].run_release(iid)
            except Exception as exc:  # noqa: BLE001 - release everything even if one fails
                logger.warning("tool %r release failed: %s: %s", name, type(exc).__name__, exc)
        if run.interaction is not None and run.interaction_id is not None:
            try:
                await run.interaction.finalize(run.interaction_id)
            except Exception as exc:  # noqa: BLE001
                logger.warning("interaction finalize failed: %s: %s", type(exc).__name__, exc)


__all__ = ["AgentState", "ToolAgentLoop"]
