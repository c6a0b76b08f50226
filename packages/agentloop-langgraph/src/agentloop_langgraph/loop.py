"""The ``react_agent`` loop: run a LangGraph graph and train on the tokens its model calls kept.

Per sample the loop creates the tool instances, wraps them as LangChain tools, builds the graph
with the configured factory around a fresh :class:`ChatModel` (one request id per trajectory),
runs it, and packages the model's recorded trajectory: generated ids with mask 1 and their
log-probs, everything else with mask 0. Nothing is rebuilt from the graph's final messages.
A graph that rewrites its history yields one output per segment (see ``on_history_rewrite``).

With a vision processor (the loop's ``processor``), images in the prompt and those tools
return are rendered through it and reach ``generate`` and the output's ``multi_modal_data``
(each segment its own, in token order), within ``max_images`` / ``max_image_pixels`` /
``max_image_bytes``.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from agentloop_core.loop import AgentLoopBase
from agentloop_core.output import AgentLoopOutput
from agentloop_core.protocol import SamplingParams
from agentloop_core.registry import register
from agentloop_core.vision import ImageLimits, messages_with_row_images
from agentloop_langgraph.chat_model import REQUEST_ID_KEY, ChatModel
from agentloop_langgraph.graph import load_graph_factory
from agentloop_langgraph.messages import HistoryRewrite, HistoryRewrittenError, RolloutLimitReachedError
from agentloop_langgraph.tools import AgentLoopTool, to_langchain_tool
from agentloop_tools.base import BaseTool, ToolKwargsError, create_instances
from agentloop_tools.loop_config import ToolLoopConfig, loop_setting, resolve_tools
from agentloop_tools.rows import row_messages, row_tools_kwargs
from agentloop_tools.tool_media import check_processor

logger = logging.getLogger(__name__)

_TOKENIZATION_FLAGS = ("tokenization_mismatch", "tokenization_mismatch_ignored", "tokenization_noncanonical")


@dataclass(frozen=True)
class ReactAgentConfig(ToolLoopConfig):
    """The ``react_agent`` keys of the rollout config (other keys are ignored): the keys every
    tool loop reads (:class:`~agentloop_tools.loop_config.ToolLoopConfig`) and the graph's.

    A graph that rewrites its history makes segments (see ``on_history_rewrite``), and some
    shared keys then count per segment: ``response_length`` is the budget of each segment (one
    training row, padded to this width); ``prompt_length`` also bounds a later segment's prompt
    (the rewritten history), and one over it ends the episode (``termination_reason=
    "prompt_length"``); ``max_assistant_turns`` counts turns over all segments, and is also
    bounded by ``recursion_limit``.
    """

    LOOP_NAME: ClassVar[str] = "react_agent"

    graph_factory: Any = None
    """``"package.module:function"`` or a callable ``(chat_model, tools, **kwargs) -> graph``;
    None: a ReAct agent (``create_agent``, or ``create_react_agent`` without ``langchain``)."""
    graph_factory_kwargs: tuple[tuple[str, Any], ...] = loop_setting((), mapping=True)
    """Extra keyword arguments for the factory, as pairs (a mapping is accepted)."""
    system_prompt: str | None = None
    """System prompt of the default ReAct agent."""
    recursion_limit: int = loop_setting(50, positive=True)
    """LangGraph's super-step limit for one run (a ReAct turn takes two)."""
    on_history_rewrite: HistoryRewrite = "segment"
    """A model call whose messages do not extend the trajectory (the graph summarised, trimmed
    or edited its history): ``segment`` starts a new segment and ``run`` returns the list of
    segments; ``error`` fails the sample (``metrics["history_rewritten"] = 1``)."""


@register("react_agent")
class ReactAgentLoop(AgentLoopBase):
    """Runs a LangGraph agent per sample and returns its model's exact tokens.

    Config: a :class:`ReactAgentConfig` (or a mapping read into one), its tools (``tools`` /
    ``tool_config_path`` / ``function_tool_path``) as for ``tool_agent``.

    Row keys: ``raw_prompt`` (chat messages, the graph's input ``{"messages": raw_prompt}``;
    image parts, or verl's ``<image>`` markers with an ``images`` column, need ``processor``),
    ``tools_kwargs`` (per tool name: ``create_kwargs`` go to ``create``, ``execute_kwargs`` /
    ``calc_reward_kwargs`` / ``release_kwargs`` to those methods, as in ``tool_agent``),
    ``request_id`` (optional). The loop has no interactions; a user turn is the graph's business.

    A graph that rewrites history (summaries, trimming, edited AI messages) makes segments:
    ``run`` returns one output per segment, in order, sharing the reward, the metrics (with
    ``num_segments``) and ``termination_reason``; each segment's ``extra_fields["messages"]`` is
    the conversation its ids encode, and from the second on ``extra_fields["segment_reason"]``
    says why it started. With ``on_history_rewrite="error"`` such a graph fails the sample with
    ``metrics["history_rewritten"] = 1`` and the reason in ``metrics["error"]``. Row
    ``tools_kwargs`` that a tool cannot take raise :class:`~agentloop_tools.base.ToolKwargsError`
    (the worker records the sample as failed).

    ``processor``: the model's :class:`~agentloop_core.vision.VisionProcessor` (None: a
    text-only model). Images a tool returns join its ``ToolMessage`` (images first, then the
    text); one over a limit, a video, or any image for a text-only model is refused with error
    text the model reads and counted (``tool_images``, ``tool_images_refused``,
    ``tool_images_no_vision``, ``tool_videos_refused``). An image in the prompt for a text-only
    model is a ``ValueError`` naming the fix (the worker records the sample as failed).
    """

    config_class: ClassVar[type | None] = ReactAgentConfig
    """This loop's typed config, built once per rollout (``RolloutConfig.with_loop_configs``)."""

    def __init__(self, server: Any, tokenizer: Any, config: ReactAgentConfig | Mapping[str, Any] | None = None,
                 processor: Any = None, tracer: Any = None) -> None:
        super().__init__(server, tokenizer, config, processor, tracer)
        self.config: ReactAgentConfig
        self.vision = check_processor(self.processor, self.config.LOOP_NAME)
        self.image_limits = ImageLimits(max_pixels=self.config.max_image_pixels,
                                        max_bytes=self.config.max_image_bytes, max_images=self.config.max_images)
        self.tools: dict[str, BaseTool] = resolve_tools(self.config)
        self.factory = load_graph_factory(self.config.graph_factory)
        kwargs = dict(self.config.graph_factory_kwargs)
        if self.config.graph_factory is None and self.config.system_prompt is not None:
            kwargs.setdefault("system_prompt", self.config.system_prompt)
        self.factory_kwargs = kwargs

    def chat_model(self, sampling_params: Mapping[str, Any] | SamplingParams, request_id: str) -> ChatModel:
        """The chat model of one trajectory."""
        cfg = self.config
        params = sampling_params.as_dict() if isinstance(sampling_params, SamplingParams) else dict(sampling_params)
        return ChatModel(
            server=self.server, tokenizer=self.tokenizer, sampling_params=params, tool_parser=cfg.tool_parser,
            request_id=request_id, response_length=cfg.response_length, prompt_length=cfg.prompt_length,
            max_assistant_turns=cfg.max_assistant_turns, apply_chat_template_kwargs=dict(cfg.apply_chat_template_kwargs),
            use_inference_chat_template=cfg.use_inference_chat_template, delta_strategy=cfg.delta_strategy,
            allow_special_tokens_in_content=cfg.allow_special_tokens_in_content,
            max_parallel_calls=cfg.max_parallel_calls, on_history_rewrite=cfg.on_history_rewrite,
            vision=self.vision, image_limits=self.image_limits)

    async def run(self, sampling_params: Mapping[str, Any] | SamplingParams,
                  **row: Any) -> AgentLoopOutput | list[AgentLoopOutput]:
        """Roll out one trajectory; see the class docstring for the row keys.

        Returns:
            The trajectory, or its segments in order when the graph rewrote its history.

        Raises:
            ValueError: a malformed row, a prompt over ``prompt_length``, or a factory that
                does not return a graph.
            ToolKwargsError: a tool cannot take the row's ``tools_kwargs``.
            Exception: whatever the graph raises besides history rewrites and rollout limits.
        """
        messages = row_messages(row, "react_agent")
        if row.get("images") is not None:  # verl's rows: <image> markers and an images column
            messages = messages_with_row_images(list(messages), row["images"], where="row")
        tools_kwargs = row_tools_kwargs(row, self.tools)
        request_id = str(row.get("request_id") or uuid.uuid4().hex)
        model = self.chat_model(sampling_params, request_id)
        adapters = await self._create_tools(tools_kwargs, model, request_id)
        termination = "graph_end"
        start = time.perf_counter()
        try:
            graph = self.factory(model, list(adapters.values()), **self.factory_kwargs)
            if not hasattr(graph, "ainvoke"):
                raise ValueError(f"graph_factory returned a {type(graph).__name__}, not a compiled graph "
                                 "(it needs ainvoke); return graph.compile()")
            config = {"recursion_limit": self.config.recursion_limit,
                      "configurable": {REQUEST_ID_KEY: request_id}}
            with self.tracer.span("graph", request_id=request_id):
                await graph.ainvoke({"messages": [dict(m) for m in messages]}, config=config)
        except RolloutLimitReachedError as exc:
            termination = exc.reason
        except HistoryRewrittenError as exc:
            logger.warning("react_agent sample failed: %s", exc)
            session = model.pop_session(request_id)
            await self._release(adapters)
            if session is None:
                return AgentLoopOutput.failure(None, exc, history_rewritten=1)
            # Counted, trains nothing; its row keeps the prompt, ids and images consistent.
            failed = AgentLoopOutput.failure(session.trajectory.prompt_ids, exc, history_rewritten=1)
            failed.multi_modal_data = self._prompt_images(session.trajectory)
            return failed
        except Exception as exc:
            from langgraph.errors import GraphRecursionError

            if not isinstance(exc, GraphRecursionError):
                await self._release(adapters)
                raise
            termination = "recursion_limit"
        graph_s = time.perf_counter() - start
        reward = await self._reward(adapters)
        await self._release(adapters)
        session = model.pop_session(request_id)
        if session is None:
            return AgentLoopOutput.failure(None, "the graph finished without calling the chat model; a "
                                           "react_agent graph must call the ChatModel it was built with")
        # A segment only closes once it generated, so only the current one can be empty (the
        # first call failed); it is then the whole trajectory, kept for its prompt.
        segments = [t for t in session.segments if t.num_generations] or [session.trajectory]
        metrics = {
            "assistant_turns": session.num_generations,
            "num_segments": len(segments),
            "tool_calls": sum(a.calls for a in adapters.values()),
            "tool_errors": sum(a.errors for a in adapters.values()),
            "tool_calls_over_limit": sum(a.calls_over_limit for a in adapters.values()),
            "tool_responses_truncated_length": sum(a.truncated_length for a in adapters.values()),
            "tool_responses_truncated_tokens": sum(a.truncated_tokens for a in adapters.values()),
            **session.media_counters,
            "generate_s": session.generate_s, "graph_s": graph_s,
        }
        tool_rewards = [r for a in adapters.values() for r in a.rewards]
        outputs = []
        for k, trajectory in enumerate(segments):
            extra = {"messages": list(trajectory.messages), "termination_reason": termination,
                     "request_id": request_id, "tool_rewards": list(tool_rewards)}
            if k:
                extra["segment_reason"] = session.rewrites[k - 1]
            out = trajectory.to_output(reward_score=reward, metrics=metrics, extra_fields=extra,
                                       sanity_check=self.config.sanity_check)
            out.segment_index = k
            outputs.append(out)
        # Per-trajectory values are read from the last segment: a tokenization flag of any
        # segment is the trajectory's.
        for key in _TOKENIZATION_FLAGS:
            if any(key in o.metrics for o in outputs):
                for o in outputs:
                    o.metrics[key] = 1
        return outputs[0] if len(outputs) == 1 else outputs

    def _prompt_images(self, trajectory: Any) -> dict[str, Any] | None:
        """The ``multi_modal_data`` of the trajectory's prompt alone: the first of its images,
        as many as fill the prompt's image tokens; None for a prompt without images."""
        if self.vision is None:
            return None
        wanted = list(trajectory.prompt_ids).count(self.vision.image_token_id)
        items, filled = [], 0
        for item in trajectory.image_items:
            if filled >= wanted:
                break
            items.append(item)
            filled += item.num_tokens
        return {"image": items} if items and filled == wanted else None

    async def _create_tools(self, tools_kwargs: dict[str, Any], model: ChatModel,
                            request_id: str) -> dict[str, AgentLoopTool]:
        cfg = self.config
        options = {"timeout_s": cfg.tool_timeout_s, "max_tool_response_length": cfg.max_tool_response_length,
                   "max_tool_response_tokens": cfg.max_tool_response_tokens, "tokenizer": self.tokenizer,
                   "tool_response_truncate_side": cfg.tool_response_truncate_side,
                   "max_parallel_calls": cfg.max_parallel_calls,
                   "is_over_limit": lambda call_id: model.is_call_over_limit(call_id, request_id),
                   "media_screen": lambda: model.media_screen(request_id),
                   "adopt_image": lambda source, item: model.adopt_image(source, item, request_id)}
        adapters: dict[str, AgentLoopTool] = {}
        misconfigured: list[ToolKwargsError] = []
        for name, result in (await create_instances(self.tools, tools_kwargs)).items():
            if isinstance(result, ToolKwargsError):
                misconfigured.append(result)
            elif isinstance(result, Exception):  # the model gets an error when it calls this tool
                why = f"{type(result).__name__}: {result}"
                logger.warning("tool %r create failed: %s", name, why)
                adapters[name] = to_langchain_tool(self.tools[name], "", unavailable=why, **options)
            else:
                adapters[name] = to_langchain_tool(self.tools[name], result, **options)
        if misconfigured:
            await self._release(adapters)
            raise misconfigured[0]
        return adapters

    async def _reward(self, adapters: dict[str, AgentLoopTool]) -> float | None:
        if self.config.tool_reward == "none":
            return None
        total = sum(r for a in adapters.values() for r in a.rewards)
        for name, adapter in adapters.items():
            if adapter.unavailable is not None:
                continue
            try:
                total += float(await self.tools[name].run_calc_reward(adapter.instance_id))
            except Exception as exc:  # noqa: BLE001 - one bad reward must not lose the trajectory
                adapter.errors += 1
                logger.warning("tool %r calc_reward failed: %s: %s", name, type(exc).__name__, exc)
        return total

    async def _release(self, adapters: dict[str, AgentLoopTool]) -> None:
        for name, adapter in adapters.items():
            if adapter.unavailable is not None:
                continue
            try:
                await self.tools[name].run_release(adapter.instance_id)
            except Exception as exc:  # noqa: BLE001 - release everything even if one fails
                logger.warning("tool %r release failed: %s: %s", name, type(exc).__name__, exc)


__all__ = ["ReactAgentConfig", "ReactAgentLoop"]
