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

Images a tool returns join its tool message as image parts (images first, then the text),
enter the trajectory once and go to every later ``generate`` in ``multi_modal_data``; see
:mod:`agentloop_tools.tool_media` for the limits and what is refused (videos; any image for a
text-only model).

Anything a tool does wrong (raises, hangs, returns junk or an image over a limit, gets bad
arguments, does not exist) becomes an error message the model reads on its next turn and a
counter in ``metrics``; it never ends the trajectory with an exception. A misconfigured row is
different: ``tools_kwargs`` that a tool cannot take
(:class:`~agentloop_tools.base.ToolKwargsError`), or naming a tool or an interaction the loop
does not have, fails the sample with the error.

Rewards: ``reward_score`` is the tools' call rewards plus their ``calc_reward`` plus the
interaction's ``calculate_score`` (``tool_reward="sum"``). ``extra_fields["turn_rewards"]`` splits
the per-turn part over the assistant turns: each call's reward on the turn that made the call,
and the interaction's score of its reply on the turn it answered (``turn_scores``, as verl keeps
them). The trainer's per-turn credit (``algorithm.turn_credit``) reads them as parts of the final
reward and puts the rest of it (``calc_reward``, ``calculate_score``, a reward function's score)
on the last turn, so the turns' rewards always add up to the trajectory's; with the default
``calculate_score`` (the last turn's score) that rest is the tools' ``calc_reward`` less the
earlier turns' scores.
"""

from __future__ import annotations

import asyncio
import enum
import json
import logging
import time
import uuid
import weakref
from collections.abc import Mapping
from typing import Any, ClassVar

from agentloop_core.loop import AgentLoopBase
from agentloop_core.output import AgentLoopOutput
from agentloop_core.parsers import ParseResult, get_tool_parser
from agentloop_core.protocol import SamplingParams, TokenOutput
from agentloop_core.reasoning import PROMPT_TAIL_TOKENS, ReasoningParser, get_reasoning_parser
from agentloop_core.registry import register
from agentloop_core.runtime.pacing import turn_slot
from agentloop_core.tokenization.shared_renderer import shared_renderer
from agentloop_core.vision import ImageError, ImageLimits, messages_with_row_images, multi_modal_kwargs
from agentloop_tools.call_limits import CallTimeoutError, call_within
from agentloop_tools.interaction import BaseInteraction, select_interaction
from agentloop_tools.loop_config import ToolAgentConfig, resolve_interactions, resolve_tools
from agentloop_tools.per_tokenizer import check_template_renders_tools, stop_token_ids
from agentloop_tools.rows import row_messages, row_tools_kwargs
from agentloop_tools.run_state import REASONING_COUNTERS, ToolRun
from agentloop_tools.schema import ToolResponse, schema_dict
from agentloop_tools.tool_media import MediaScreen, check_processor, strip_images, tool_limits
from agentloop_tools.truncation import cut_tool_response

logger = logging.getLogger(__name__)

_TOOLS_SHOWN: weakref.WeakSet[Any] = weakref.WeakSet()
"""Renderers whose template was found to show the model its tools (asked once per renderer)."""


class AgentState(enum.Enum):
    """Where a trajectory is in the tool agent loop."""

    PENDING = "pending"
    GENERATING = "generating"
    PROCESSING_TOOLS = "processing_tools"
    INTERACTING = "interacting"
    TERMINATED = "terminated"


@register("tool_agent")
class ToolAgentLoop(AgentLoopBase):
    """Generates, runs the tools the model calls, feeds results back, repeats.

    Config: a :class:`ToolAgentConfig` (or a mapping read into one): its tools (``tools`` /
    ``tool_config_path`` / ``function_tool_path``, see :func:`resolve_tools`) and interactions
    (``interaction`` or ``interaction_config_path``, see :func:`resolve_interactions`) included.

    Row keys: ``raw_prompt`` (chat messages; image parts, or verl's ``<image>`` markers with an
    ``images`` column), ``tools_kwargs`` (per tool name: ``create_kwargs``
    go to ``create``, ``execute_kwargs`` / ``calc_reward_kwargs`` / ``release_kwargs`` to those
    methods, see :mod:`agentloop_tools.base`), ``interaction_kwargs`` (passed whole to
    ``Interaction.start``; its ``name`` picks the interaction when several are configured),
    ``request_id`` (optional; one id for all turns keeps them on one replica's prefix cache).

    ``processor``: the model's :class:`~agentloop_core.vision.VisionProcessor` (None: a
    text-only model); prompts may then hold image parts, and tools may return images.
    """

    config_class: ClassVar[type | None] = ToolAgentConfig
    """This loop's typed config, built once per rollout (``RolloutConfig.with_loop_configs``)."""

    def __init__(self, server: Any, tokenizer: Any, config: ToolAgentConfig | Mapping[str, Any] | None = None,
                 processor: Any = None, tracer: Any = None) -> None:
        super().__init__(server, tokenizer, config, processor, tracer)
        self.config: ToolAgentConfig
        self.tools = resolve_tools(self.config)
        self._init_parsers()
        self._init_vision()
        self.interactions: dict[str, BaseInteraction] = resolve_interactions(self.config)
        schemas = [schema_dict(tool) for tool in self.tools.values()]
        self.tool_specs: dict[str, dict[str, Any]] = dict(zip(self.tools, schemas, strict=True))
        """The tools' schemas by name, as the template shows them: what the parser checks calls
        against (a pydantic dump of a tool's schema at every call was ~2% of a turn)."""
        self.renderer = self._make_renderer(schemas)
        if schemas and self.renderer not in _TOOLS_SHOWN:  # a shared renderer is checked once
            check_template_renders_tools(self.renderer, sorted(self.tools))
            _TOOLS_SHOWN.add(self.renderer)

    def _init_parsers(self) -> None:
        """The tool parser, the reasoning parser (checked against it) and the stop token ids."""
        self.parser = get_tool_parser(self.config.tool_parser)
        self.reasoning_parser: ReasoningParser | None = None
        if self.config.reasoning_parser is not None:
            self.reasoning_parser = get_reasoning_parser(self.config.reasoning_parser)
            if self.reasoning_parser.needs_special_tokens and not self.parser.needs_special_tokens:
                raise ValueError(
                    f"reasoning_parser {self.config.reasoning_parser!r} reads special tokens that tool_parser "
                    f"{self.config.tool_parser!r} has decoded away; use the tool parser of the same family "
                    "(multi_turn.tool_parser: gpt_oss)")
        self.stop_token_ids = stop_token_ids(self.tokenizer, self.parser.stop_tokens)

    def _init_vision(self) -> None:
        """The vision processor (checked) and the image limits of this loop's trajectories."""
        self.vision = check_processor(self.processor, self.config.LOOP_NAME)
        cfg = self.config
        self.image_limits = ImageLimits(max_pixels=cfg.max_image_pixels, max_bytes=cfg.max_image_bytes,
                                        max_images=cfg.max_images)

    def _make_renderer(self, schemas: list[dict[str, Any]]) -> Any:
        """The chat renderer of this loop's trajectories, with ``schemas`` as ``tools=``: one per
        tokenizer and settings, shared by every loop built with them (see :mod:`agentloop_core.tokenization.shared_renderer`)."""
        return shared_renderer(
            self.tokenizer, tools=schemas or None,
            use_inference_chat_template=self.config.use_inference_chat_template,
            apply_chat_template_kwargs=dict(self.config.apply_chat_template_kwargs),
            delta_strategy=self.config.delta_strategy, vision=self.vision,
            allow_special_tokens_in_content=self.config.allow_special_tokens_in_content,
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
        if row.get("images") is not None:  # verl's rows: <image> markers and an images column
            messages = messages_with_row_images(list(messages), row["images"], where="row")
        tools_kwargs = row_tools_kwargs(row, self.tools)
        base, per_turn_cap = self._sampling(sampling_params)
        trajectory = self._new_trajectory(messages)
        interaction_kwargs = dict(row.get("interaction_kwargs") or {})
        run = ToolRun(request_id=str(row.get("request_id") or uuid.uuid4().hex),
                      interaction=select_interaction(self.interactions, interaction_kwargs))
        if self.reasoning_parser is not None:
            run.counters.update(dict.fromkeys(REASONING_COUNTERS, 0))
        try:
            await run.create_instances(self.tools, tools_kwargs)
            if run.interaction is not None:
                run.interaction_id = await self._scoring(run.interaction.start(None, **interaction_kwargs),
                                                         "interaction start")
            await self._loop(run, trajectory, base, per_turn_cap)
            reward = await self._reward(run)
        finally:
            await run.release(self.tools)
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

        trajectory = Trajectory(self.renderer, list(messages), sanity_check=self.config.sanity_check,
                                image_limits=self.image_limits)
        limit = self.config.prompt_length
        if limit is not None and len(trajectory.prompt_ids) > limit:
            raise ValueError(f"rendered prompt has {len(trajectory.prompt_ids)} tokens, more than "
                             f"prompt_length={limit}; raise prompt_length or filter long prompts")
        return trajectory

    def _output(self, run: ToolRun, trajectory: Any, reward: float | None, extra: dict[str, Any]) -> AgentLoopOutput:
        """The trajectory as an output with the run's metrics and ``extra`` over the common fields."""
        metrics = {**run.counters, **run.stops.metrics(), "assistant_turns": run.assistant_turns,
                   "user_turns": run.user_turns, "turns": run.assistant_turns + run.user_turns}
        extra = {"messages": list(trajectory.messages), "termination_reason": run.termination,
                 "request_id": run.request_id, "reported_metrics": list(run.reported),
                 "turn_rewards": run.turn_reward_list(), **extra}
        return trajectory.to_output(reward_score=reward, metrics=metrics, extra_fields=extra,
                                    sanity_check=self.config.sanity_check)

    async def _loop(self, run: ToolRun, trajectory: Any, base: SamplingParams, per_turn_cap: int | None) -> None:
        cfg = self.config
        state = AgentState.GENERATING
        parsed: ParseResult | None = None
        # One SamplingParams per distinct max_tokens (usually one per trajectory): building and
        # checking a copy at every turn was ~3% of a turn's CPU (bench_scale.py, issue 49).
        params = base
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
                if params.max_tokens != max_tokens:
                    params = base.replace(max_tokens=max_tokens)
                start = time.perf_counter()
                with self.tracer.span("generate", turn=run.assistant_turns, request_id=run.request_id):
                    # Text-only prompts add no keyword, so text-only engines are called as before.
                    out: TokenOutput = await self.server.generate(
                        run.request_id, trajectory.context_ids, params,
                        **multi_modal_kwargs(trajectory.image_items))
                run.counters["generate_s"] += time.perf_counter() - start
                run.stops.add(out.stop_reason, len(out.token_ids), max_tokens, per_turn_cap)
                trajectory.append_generated(out)
                run.assistant_turns += 1
                run.ended_with_eos = self.renderer.ended_turn(out.token_ids, out.stop_reason)
                state, parsed = self._after_generate(run, trajectory, out)
                # Its ids and log-probs are the trajectory's now; the record itself would stay
                # alive through the tools and the next generate (issue 49: memory per trajectory).
                del out
            elif state is AgentState.PROCESSING_TOOLS:
                assert parsed is not None
                tool_messages = await self._run_tools(run, parsed, trajectory)
                parsed = None
                state = self._append(run, trajectory, tool_messages)
                del tool_messages  # appended (as copies) to the trajectory's messages
            elif state is AgentState.INTERACTING:
                state = await self._interact(run, trajectory)
        if run.termination == "response_length" or len(trajectory.response_ids) >= cfg.response_length:
            run.stops.response_budget = True

    def _after_generate(self, run: ToolRun, trajectory: Any, out: TokenOutput) -> tuple[AgentState, ParseResult | None]:
        cfg = self.config
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
        elif self.renderer.tokenizer is self.tokenizer:
            # The same text as the tokenizer's decode, without transformers' wrapper around the
            # fast backend (it cost three times the decode itself; issue 49, CPU per turn).
            text = self.renderer.decode(out.token_ids, skip_special_tokens=True)
        else:
            text = self.tokenizer.decode(out.token_ids, skip_special_tokens=True)
        parsed = self._parse_turn(run, text)
        run.counters["parse_errors"] += len(parsed.errors)
        if cfg.max_assistant_turns is not None and run.assistant_turns >= cfg.max_assistant_turns:
            run.termination = "max_assistant_turns"
            return AgentState.TERMINATED, None
        return self._next_state(run, trajectory, parsed)

    def _next_state(self, run: ToolRun, trajectory: Any, parsed: ParseResult) -> tuple[AgentState, ParseResult | None]:
        """Where a turn that may go on leads: its calls run, else the interaction, else the end."""
        if parsed.attempted:
            self._attach_calls(run, trajectory, parsed)
            return AgentState.PROCESSING_TOOLS, parsed
        if run.interaction is not None:
            return AgentState.INTERACTING, None
        run.termination = "no_tool_call"
        return AgentState.TERMINATED, None

    def _parse_turn(self, run: ToolRun, text: str) -> ParseResult:
        """The turn's calls: from its content when a reasoning parser splits it (counting the
        calls drafted in the reasoning), else from all of it."""
        run.turn_text = (text, text, None)
        if self.reasoning_parser is None:
            return self.parser.parse(text, self.tool_specs)
        split = self.reasoning_parser.split(text, in_reasoning=run.starts_in_reasoning)
        run.turn_text = (text, split.content, split.reasoning if split.has_reasoning else None)
        drafted = 0
        if split.has_reasoning:
            run.counters["reasoning_turns"] += 1
            run.counters["reasoning_chars"] += len(split.reasoning)
            # Parsed only to count; record=False keeps the parser's counters one per turn.
            inner = self.parser.parse(split.reasoning, self.tool_specs, record=False)
            drafted = len(inner.calls) + len(inner.errors)
        run.counters["reasoning_unclosed"] += not split.closed
        run.counters["tool_calls_in_reasoning"] += drafted
        if self.config.tool_calls_in_reasoning:
            return self.parser.parse(text, self.tool_specs)
        run.counters["tool_calls_in_reasoning_ignored"] += drafted
        return self.parser.parse(split.content, self.tool_specs)

    def _attach_calls(self, run: ToolRun, trajectory: Any, parsed: ParseResult) -> None:
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

    def _append(self, run: ToolRun, trajectory: Any, new_messages: list[dict[str, Any]]) -> AgentState:
        """Append tool or user messages unless they would leave no room to generate."""
        try:
            delta = trajectory.preview_messages(new_messages)  # append_messages reuses it
        except (ImageError, ValueError) as exc:
            # The last resort: the screen processed (and refused) each image on its own, so this
            # is a render that fails for another reason; the turn goes on without its images.
            new_messages, count = strip_images(new_messages, str(exc)[:300])
            if not count:
                raise
            run.counters["tool_images"] -= count
            run.counters["tool_images_refused"] += count
            delta = trajectory.preview_messages(new_messages)
        if len(trajectory.response_ids) + len(delta) >= self.config.response_length:
            # Truncating the delta would cut the template mid-turn; dropping it ends cleanly.
            run.termination = "response_length"
            run.counters["dropped_message_tokens"] = len(delta)
            return AgentState.TERMINATED
        trajectory.append_messages(new_messages)
        return AgentState.GENERATING

    async def _interact(self, run: ToolRun, trajectory: Any) -> AgentState:
        assert run.interaction is not None
        assert run.interaction_id is not None
        limit = self.config.max_user_turns
        if limit is not None and run.user_turns >= limit:
            run.termination = "max_user_turns"
            return AgentState.TERMINATED
        start = time.perf_counter()
        with self.tracer.span("interaction", turn=run.user_turns, request_id=run.request_id):
            done, text, score, metrics = await self._scoring(run.interaction.generate_response(
                run.interaction_id, list(trajectory.messages)), "interaction generate_response")
        run.counters["interaction_s"] += time.perf_counter() - start
        await turn_slot()
        run.add_metrics("interaction", run.user_turns, metrics)
        run.turn_scores.append(float(score))
        run.credit_turn(float(score))
        if done:
            run.termination = "interaction"
            return AgentState.TERMINATED
        run.user_turns += 1
        return self._append(run, trajectory, [{"role": "user", "content": str(text)}])

    # --- tools ---------------------------------------------------------------------------------

    async def _run_tools(self, run: ToolRun, parsed: ParseResult, trajectory: Any) -> list[dict[str, Any]]:
        limit = self.config.max_parallel_calls
        screen = MediaScreen(self.vision, tool_limits(self.image_limits), trajectory.images.count, run.counters,
                             conversation=trajectory.images)
        ids = iter(run.call_ids)  # one per call, then one per error (see _attach_calls)
        start = time.perf_counter()
        results = await asyncio.gather(*(run.call_tool(self.tools.get(call.name), call, self.config.tool_timeout_s, self.tracer)
                                         for call in parsed.calls[:limit]))
        run.counters["tool_calls_s"] += time.perf_counter() - start
        await turn_slot()  # tool calls end in bursts (a thread pool's whole switch interval at once)
        messages = []
        for call, response in zip(parsed.calls[:limit], results, strict=True):
            messages.append(self._tool_message(run, call.name, next(ids), response, screen))
        for call in parsed.calls[limit:]:
            run.counters["tool_errors"] += 1
            run.counters["tool_calls_over_limit"] += 1
            messages.append(self._tool_message(run, call.name, next(ids),
                                               f"Error: too many tool calls in one turn (limit {limit}); "
                                               f"this call to {call.name!r} was not run. Call it again next turn."))
        for error in parsed.errors:
            messages.append(self._tool_message(run, error.name or "", next(ids), f"Error: {error.reason}"))
        return messages

    def _tool_message(self, run: ToolRun, name: str, call_id: str, response: ToolResponse | str,
                      screen: MediaScreen | None = None) -> dict[str, Any]:
        """The tool message answering one call: the response's text cut to the limits (the
        images are never cut), its images screened into parts before the text."""
        if isinstance(response, str):
            response = ToolResponse(text=response)
        cfg = self.config
        cut = cut_tool_response(response.text or "", cfg.tool_response_truncate_side,
                                max_length=cfg.max_tool_response_length, max_tokens=cfg.max_tool_response_tokens,
                                tokenizer=self.tokenizer)
        # Which limit cut it, so a run can see whether its tools' output is being lost.
        run.counters["tool_responses_truncated_length"] += cut.by_length
        run.counters["tool_responses_truncated_tokens"] += cut.by_tokens
        content: Any = cut.text
        if screen is not None and (response.image or response.video):
            content = screen.tool_content(name, cut.text, response.image, response.video)
        return {"role": "tool", "name": name, "tool_call_id": call_id, "content": content}

    async def _reward(self, run: ToolRun) -> float | None:
        if self.config.tool_reward == "none":
            return None
        total = sum(run.tool_rewards)
        with self.tracer.span("reward", request_id=run.request_id):
            for name, iid in run.instances.items():
                try:
                    total += float(await self._scoring(self.tools[name].run_calc_reward(iid),
                                                       f"tool {name!r} calc_reward"))
                except CallTimeoutError:
                    raise  # a reward missing a part is a wrong reward: the sample fails
                except Exception as exc:  # noqa: BLE001
                    run.counters["tool_errors"] += 1
                    logger.warning("tool %r calc_reward failed: %s: %s", name, type(exc).__name__, exc)
            if run.interaction is not None and run.interaction_id is not None:
                total += float(await self._scoring(run.interaction.calculate_score(run.interaction_id),
                                                   "interaction calculate_score"))
        return total

    def _scoring(self, awaitable: Any, what: str) -> Any:
        return call_within(awaitable, self.config.scoring_timeout_s, what,
                           "actor_rollout_ref.rollout.agent.loops.tool_agent.scoring_timeout_s")


__all__ = ["AgentState", "ToolAgentLoop"]
