"""Per-trajectory bookkeeping of the tool loops (``tool_agent``, ``env_agent``): the counters
that become a trajectory's ``metrics``, what a turn left for the next one, and the tools'
lifecycle in the trajectory (create its instances, run its calls, release them)."""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from agentloop_core.parsers import ToolCall
from agentloop_core.stops import StopCounter
from agentloop_tools.base import BaseTool, ToolKwargsError, create_instances
from agentloop_tools.call_limits import within
from agentloop_tools.interaction import BaseInteraction
from agentloop_tools.schema import ToolResponse
from agentloop_tools.tool_media import MEDIA_COUNTERS

__all__ = ["REASONING_COUNTERS", "ToolRun"]

logger = logging.getLogger("agentloop_tools.agent_loop")  # the loop's logger: warnings keep their source

REASONING_COUNTERS = ("reasoning_turns", "reasoning_chars", "reasoning_unclosed", "tool_calls_in_reasoning",
                      "tool_calls_in_reasoning_ignored")
"""Metrics of a loop with a reasoning parser: turns with reasoning, its characters, turns that
ended inside it, calls (usable or not) written inside it, and those of them not run."""


@dataclass
class ToolRun:
    """Per-trajectory bookkeeping of ``tool_agent`` (and of the loops built on it)."""

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
    turn_rewards: list[float] = field(default_factory=list)
    """Per assistant turn, the rewards earned by it that are part of ``reward_score`` (see
    :meth:`credit_turn`); ``extra_fields["turn_rewards"]``, one entry per generated turn."""
    counters: dict[str, float] = field(default_factory=lambda: dict.fromkeys(
        ("tool_calls", "tool_errors", "parse_errors", "tool_calls_over_limit", *MEDIA_COUNTERS, "dropped_message_tokens",
         "tool_responses_truncated_length", "tool_responses_truncated_tokens",
         "generate_s", "tool_calls_s", "interaction_s"), 0))
    """The trajectory's counters (``metrics``): calls, errors, tool images (``MEDIA_COUNTERS``),
    truncations, timings; tools' and the interaction's numbers are added by :meth:`add_metrics`."""
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

    def credit_turn(self, reward: float) -> None:
        """Add ``reward`` to the turn generated last (a tool call's reward to the turn that made
        the call, an environment step's or interaction reply's to the turn it answered)."""
        turn = self.assistant_turns - 1
        if turn < 0:
            raise ValueError("credit_turn before any assistant turn was generated")
        self.turn_rewards.extend([0.0] * (turn + 1 - len(self.turn_rewards)))
        self.turn_rewards[turn] += float(reward)

    def turn_reward_list(self) -> list[float]:
        """:attr:`turn_rewards` with one entry per generated turn (0.0 for a turn nothing credited)."""
        return self.turn_rewards + [0.0] * (self.assistant_turns - len(self.turn_rewards))

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

    # -- the tools' lifecycle in this trajectory (create, call, release) -----------------------

    async def create_instances(self, tools: Mapping[str, BaseTool], tools_kwargs: dict[str, Any]) -> None:
        """Create this trajectory's instance of every tool; a tool whose create failed answers its
        calls with the error. Raises the first :class:`ToolKwargsError` (the row is misconfigured)."""
        misconfigured: list[ToolKwargsError] = []
        for name, result in (await create_instances(tools, tools_kwargs)).items():
            if isinstance(result, ToolKwargsError):
                misconfigured.append(result)
            elif isinstance(result, Exception):  # the model gets an error when it calls this tool
                self.create_errors[name] = f"{type(result).__name__}: {result}"
                logger.warning("tool %r create failed for request %s: %s", name, self.request_id, self.create_errors[name])
            else:
                self.instances[name] = result
        if misconfigured:  # run() releases the instances that were created
            raise misconfigured[0]

    async def call_tool(self, tool: BaseTool | None, call: ToolCall, default_timeout_s: float | None,
                        tracer: Any) -> ToolResponse | str:
        """Run one call with ``tool`` (None: no such tool): its response, or error text for the
        model (every failure); ``default_timeout_s`` for a tool without a ``timeout_s`` of its own."""
        self.counters["tool_calls"] += 1
        if tool is None or call.name not in self.instances:
            self.counters["tool_errors"] += 1
            why = self.create_errors.get(call.name, "no such tool")
            return f"Error: tool {call.name!r} is unavailable ({why})."
        timeout = tool.timeout_s if tool.timeout_s is not None else default_timeout_s
        with tracer.span(f"tool:{call.name}", request_id=self.request_id) as span:
            try:
                result = await within(tool.run_execute(self.instances[call.name], dict(call.arguments)), timeout)
            except asyncio.TimeoutError:
                self.counters["tool_errors"] += 1
                span["tool_error"] = "timeout"
                return f"Error: tool {call.name!r} timed out after {timeout:g} s."
            except Exception as exc:  # noqa: BLE001 - a tool bug must not end the trajectory
                self.counters["tool_errors"] += 1
                span["tool_error"] = type(exc).__name__
                return f"Error: tool {call.name!r} failed: {type(exc).__name__}: {exc}"
        if not (isinstance(result, tuple) and len(result) == 3 and isinstance(result[0], ToolResponse)):
            self.counters["tool_errors"] += 1
            logger.warning("tool %r returned %s; execute must return (ToolResponse, reward, metrics)",
                           call.name, type(result).__name__)
            return f"Error: tool {call.name!r} returned an invalid result."
        response, reward, metrics = result
        self.add_metrics(f"tool/{call.name}", self.assistant_turns, metrics)
        try:
            self.tool_rewards.append(float(reward or 0.0))
        except (TypeError, ValueError):
            self.counters["tool_errors"] += 1
            self.tool_rewards.append(0.0)
        self.credit_turn(self.tool_rewards[-1])
        return response

    async def release(self, tools: Mapping[str, BaseTool]) -> None:
        """Release every tool instance and finalize the interaction, whatever fails."""
        for name, iid in self.instances.items():
            try:
                await tools[name].run_release(iid)
            except Exception as exc:  # noqa: BLE001 - release everything even if one fails
                logger.warning("tool %r release failed: %s: %s", name, type(exc).__name__, exc)
        if self.interaction is not None and self.interaction_id is not None:
            try:
                await self.interaction.finalize(self.interaction_id)
            except Exception as exc:  # noqa: BLE001
                logger.warning("interaction finalize failed: %s: %s", type(exc).__name__, exc)
