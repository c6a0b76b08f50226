"""The environment loop, registered as ``env_agent``: runs any registered
:class:`~agentloop_core.environment.Environment` with exact tokens.

It is ``tool_agent``'s machinery with the environment in the place of the tools and the
interaction: the same generation, stop tokens, limits (``max_assistant_turns``,
``response_length``, ``max_tool_response_length`` / ``max_tool_response_tokens`` on every
message the environment returns), reasoning split (``reasoning_parser``,
``tool_calls_in_reasoning``) and delta tokenization, so the trajectory and its masks are built
exactly as ``tool_agent`` builds them: generated tokens as the engine returned them (mask 1),
the environment's messages rendered by the chat template as a delta (mask 0). Image parts of
the environment's messages (any form :mod:`agentloop_core.vision.content` reads) enter the
conversation as a tool's images do: screened by :class:`~agentloop_tools.tool_media.MediaScreen`
(a refused image or a video becomes a text part with the error, in its place; file paths are
accepted, as in the prompt), then in ``multi_modal_data`` of every later ``generate``. The
limits cut each text part, never an image.

Per trajectory: the environment is built with ``environment_kwargs``, reset with the row, its
:meth:`~agentloop_core.environment.Environment.tool_schemas` rendered into the prompt, stepped
once per assistant turn that ended cleanly (a turn cut by ``length`` or ``aborted`` ends the
trajectory unstepped) and closed at the end, also when something failed. An environment that
raises fails the sample with an :class:`~agentloop_core.environment.EnvironmentError` naming it.

Reward: ``reward_score`` is the sum of the step rewards (``extra_fields["step_rewards"]``, one
per step); ``tool_reward="none"`` (the trainer's ``reward.source=function``) leaves it None.
``extra_fields["turn_rewards"]`` holds them per assistant turn (the stepped turn's reward; 0.0
for a last turn cut unstepped), for the trainer's per-turn credit (``algorithm.turn_credit``).
The trajectory's tools are the environment's: ``tools`` / ``tool_config_path`` of the rollout
config are not used by this loop.
"""

from __future__ import annotations

import logging
import math
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from agentloop_core.environment import (
    AssistantTurn,
    Environment,
    EnvironmentError,
    get_environment_class,
)
from agentloop_core.output import AgentLoopOutput
from agentloop_core.parsers import ParseResult
from agentloop_core.protocol import SamplingParams
from agentloop_core.registry import register
from agentloop_tools.agent_loop import AgentState, ToolAgentLoop
from agentloop_tools.call_limits import CallTimeoutError, call_within
from agentloop_tools.loop_config import ToolLoopConfig, loop_setting
from agentloop_tools.per_tokenizer import check_template_renders_tools
from agentloop_tools.run_state import REASONING_COUNTERS, ToolRun
from agentloop_tools.tool_media import MediaScreen
from agentloop_tools.truncation import cut_tool_response

__all__ = ["ENV_TIMEOUT_KEY", "EnvAgentConfig", "EnvAgentLoop", "row_environment"]

ENV_TIMEOUT_KEY = "actor_rollout_ref.rollout.agent.loops.env_agent.env_timeout_s"
"""The trainer's key of :attr:`EnvAgentConfig.env_timeout_s`, named in its errors."""

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EnvAgentConfig(ToolLoopConfig):
    """The ``env_agent`` keys of the rollout config (trainer:
    ``actor_rollout_ref.rollout.agent.loops.env_agent.<key>``); other keys are ignored."""

    LOOP_NAME: ClassVar[str] = "env_agent"

    environment: str | None = None
    """Environment of rows that do not name one (``extra_info.environment``): a registered name
    (``agentloop_core.environment.environment_names()``) or ``pkg.module:Class``."""
    environment_kwargs: tuple[tuple[str, Any], ...] = loop_setting((), mapping=True)
    """Keyword arguments of the environment's constructor, as pairs (a row's
    ``extra_info.environment_kwargs`` go over them)."""
    env_timeout_s: float | None = loop_setting(300.0, positive=True)
    """The most seconds one ``reset``, ``step`` or ``close`` of the environment may take; past it
    the sample fails with an ``EnvironmentError`` naming the call (the batch goes on). It bounds
    what the call awaits: a step that blocks the event loop itself (``time.sleep`` in an async
    method) cannot be cut. None: no limit."""


def row_environment(row: Mapping[str, Any], config: EnvAgentConfig) -> tuple[str, dict[str, Any]]:
    """``(environment name, constructor kwargs)`` of a row: its ``environment`` (top level or in
    ``extra_info``), else the config's; the row's ``environment_kwargs`` over the config's.

    Raises:
        ValueError: neither the row nor the config names an environment.
    """
    extra = row.get("extra_info") or {}
    name = row.get("environment") or extra.get("environment") or config.environment
    if not name:
        raise ValueError("env_agent row names no environment: set extra_info.environment in the row, or "
                         "actor_rollout_ref.rollout.agent.loops.env_agent.environment=NAME (known: "
                         f"{_known()})")
    kwargs = {**dict(config.environment_kwargs),
              **dict(row.get("environment_kwargs") or extra.get("environment_kwargs") or {})}
    return str(name), kwargs


def _known() -> str:
    from agentloop_core.environment import environment_names

    return ", ".join(environment_names()) or "(none)"


@dataclass
class _EnvRun(ToolRun):
    """Per-trajectory bookkeeping of ``env_agent``: ``ToolRun``'s, plus the environment's."""

    env: Environment | None = None
    env_name: str = ""
    step_rewards: list[float] = field(default_factory=list)
    step_infos: list[dict[str, Any]] = field(default_factory=list)
    parsed: ParseResult | None = None
    """The last turn's calls, for the step."""
    last_token_ids: tuple[int, ...] = ()
    last_stop_reason: str = "stop"


@register("env_agent")
class EnvAgentLoop(ToolAgentLoop):
    """Runs an environment: reset from the row, step on each assistant turn, until it is done
    or a limit ends the trajectory. Config: an :class:`EnvAgentConfig`.

    Row keys: ``raw_prompt`` (what :meth:`Environment.reset` returns by default),
    ``extra_info.environment`` / ``extra_info.environment_kwargs`` (see :func:`row_environment`),
    ``request_id`` (optional), and whatever the environment's ``reset`` reads.
    """

    config_class: ClassVar[type | None] = EnvAgentConfig

    def __init__(self, server: Any, tokenizer: Any, config: EnvAgentConfig | Mapping[str, Any] | None = None,
                 processor: Any = None, tracer: Any = None) -> None:
        # Not ToolAgentLoop.__init__: the tools and the renderer's schemas are the environment's.
        super(ToolAgentLoop, self).__init__(server, tokenizer, config, processor, tracer)
        self.config: EnvAgentConfig  # pyright: ignore[reportIncompatibleVariableOverride] - set by the base from config_class
        self.tools: dict[str, Any] = {}
        self.tool_specs = self.tools  # the environment's schemas are the specs the parser checks
        self.interactions = {}
        self._init_parsers()
        self._init_vision()

    def conformance_profile(self) -> dict[str, Any]:
        """For the conformance suite (``agentloop_conformance.turns``): the tools of the
        configured default environment (built once to ask) and the call format."""
        tools: dict[str, Any] = {}
        if self.config.environment:
            env = get_environment_class(self.config.environment)(**dict(self.config.environment_kwargs))
            tools = {_schema_name(self.config.environment, s): s for s in env.tool_schemas()}
        return {"tools": tools, "tool_parser": self.config.tool_parser}

    async def run(self, sampling_params: Mapping[str, Any] | SamplingParams, **row: Any) -> AgentLoopOutput:
        """Roll out one episode; see the class docstring for the row keys.

        Raises:
            ValueError: the row names no environment, or the prompt is longer than ``prompt_length``.
            UnknownEnvironmentError: the environment is not registered.
            EnvironmentError: the environment raised or returned something malformed.
        """
        name, kwargs = row_environment(row, self.config)
        env_class = get_environment_class(name)
        run = _EnvRun(request_id=str(row.get("request_id") or uuid.uuid4().hex), env_name=name)
        if self.reasoning_parser is not None:
            run.counters.update(dict.fromkeys(REASONING_COUNTERS, 0))
        run.counters.update(env_step_s=0.0, env_steps=0)
        try:
            env = run.env = _call(name, "__init__", lambda: env_class(**kwargs))
            messages = await _acall(name, "reset", env.reset(row), self.config.env_timeout_s)
            schemas = _call(name, "tool_schemas", env.tool_schemas)
            self.tools = self.tool_specs = {_schema_name(name, s): s for s in schemas}
            self.renderer = self._make_renderer(list(schemas))
            if schemas:
                check_template_renders_tools(self.renderer, sorted(self.tools), loop_name=f"env_agent ({name})")
            trajectory = self._new_trajectory(_messages(name, "reset", messages))
            base, per_turn_cap = self._sampling(sampling_params)
            await self._loop(run, trajectory, base, per_turn_cap)
        except BaseException:
            if run.env is not None:
                try:
                    await _acall(name, "close", run.env.close(), self.config.env_timeout_s)
                except Exception as exc:  # noqa: BLE001 - the first failure is the sample's reason
                    logger.warning("environment %r close failed after an error: %s: %s", name, type(exc).__name__, exc)
            raise
        await _acall(name, "close", env.close(), self.config.env_timeout_s)
        reward = None if self.config.tool_reward == "none" else float(sum(run.step_rewards))
        return self._output(run, trajectory, reward, {
            "environment": name, "step_rewards": list(run.step_rewards), "step_infos": list(run.step_infos)})

    def _after_generate(self, run: ToolRun, trajectory: Any, out: Any) -> tuple[AgentState, ParseResult | None]:
        assert isinstance(run, _EnvRun)
        run.last_token_ids = tuple(out.token_ids)
        run.last_stop_reason = out.stop_reason
        return super()._after_generate(run, trajectory, out)

    def _next_state(self, run: ToolRun, trajectory: Any, parsed: ParseResult) -> tuple[AgentState, ParseResult | None]:
        """Every turn that may go on is stepped (the INTERACTING state is the environment's)."""
        assert isinstance(run, _EnvRun)
        run.call_ids = []
        if parsed.attempted:
            self._attach_calls(run, trajectory, parsed)
        run.parsed = parsed
        return AgentState.INTERACTING, None

    async def _interact(self, run: ToolRun, trajectory: Any) -> AgentState:
        assert isinstance(run, _EnvRun)
        assert run.env is not None
        assert run.parsed is not None
        parsed, ids = run.parsed, run.call_ids
        text, content, reasoning = run.turn_text
        turn = AssistantTurn(
            text=text, content=content, reasoning=reasoning, tool_calls=tuple(parsed.calls),
            tool_call_ids=tuple(ids[:len(parsed.calls)]), tool_call_errors=tuple(parsed.errors),
            error_call_ids=tuple(ids[len(parsed.calls):]), token_ids=run.last_token_ids,
            stop_reason=run.last_stop_reason, index=run.assistant_turns - 1)
        start = time.perf_counter()
        with self.tracer.span(f"env:{run.env_name}", turn=turn.index, request_id=run.request_id):
            result = await _acall(run.env_name, "step", run.env.step(turn), self.config.env_timeout_s)
        run.counters["env_step_s"] += time.perf_counter() - start
        run.counters["env_steps"] += 1
        run.counters["tool_calls"] += len(parsed.calls)  # what the environment was handed (as tool_agent counts)
        messages, reward, done, info = self._read_step(run, result)
        run.step_rewards.append(reward)
        run.credit_turn(reward)
        run.step_infos.append({"turn": turn.index, "reward": reward, "done": done, "info": info})
        run.add_metrics("env", turn.index, info or None)
        if done:
            run.termination = "env_done"
            return AgentState.TERMINATED
        if not messages:
            raise EnvironmentError(f"environment {run.env_name!r} step returned no messages and done=False; "
                                   "return the feedback the model should read next, or done=True")
        run.user_turns += sum(m.get("role") == "user" for m in messages)
        screen = MediaScreen(self.vision, self.image_limits, trajectory.images.count, run.counters,
                             conversation=trajectory.images)
        where = f"environment {run.env_name!r} step {turn.index} message"
        return self._append(run, trajectory, [screen.message(m, f"{where} {i}", lambda text: self._cut(run, text))
                                              for i, m in enumerate(messages)])

    def _read_step(self, run: _EnvRun, result: Any) -> tuple[list[dict[str, Any]], float, bool, dict[str, Any]]:
        name = run.env_name
        if not (isinstance(result, tuple) and len(result) == 4):
            raise EnvironmentError(f"environment {name!r} step must return (messages, reward, done, info), "
                                   f"got {type(result).__name__}")
        messages, reward, done, info = result
        try:
            reward = float(reward)
        except (TypeError, ValueError):
            raise EnvironmentError(f"environment {name!r} step returned reward {reward!r}; it must be a number") from None
        if not math.isfinite(reward):
            raise EnvironmentError(f"environment {name!r} step returned a non-finite reward {reward!r}")
        if info is not None and not isinstance(info, Mapping):
            raise EnvironmentError(f"environment {name!r} step returned info of type {type(info).__name__}; "
                                   "it must be a dict")
        return _messages(name, "step", messages or []), reward, bool(done), dict(info or {})

    def _cut(self, run: ToolRun, text: str) -> str:
        """A message's text (its string content, or one text part) cut to the loop's
        tool-response limits."""
        cfg = self.config
        cut = cut_tool_response(text, cfg.tool_response_truncate_side, max_length=cfg.max_tool_response_length,
                                max_tokens=cfg.max_tool_response_tokens, tokenizer=self.tokenizer)
        run.counters["tool_responses_truncated_length"] += cut.by_length
        run.counters["tool_responses_truncated_tokens"] += cut.by_tokens
        return cut.text


def _call(name: str, method: str, fn: Any) -> Any:
    try:
        return fn()
    except EnvironmentError:
        raise
    except Exception as exc:
        raise EnvironmentError(f"environment {name!r} {method} failed: {type(exc).__name__}: {exc}") from exc


async def _acall(name: str, method: str, awaitable: Any, timeout_s: float | None) -> Any:
    try:
        return await call_within(awaitable, timeout_s, f"environment {name!r} {method}", ENV_TIMEOUT_KEY)
    except EnvironmentError:
        raise
    except CallTimeoutError as exc:
        raise EnvironmentError(str(exc)) from None
    except Exception as exc:
        raise EnvironmentError(f"environment {name!r} {method} failed: {type(exc).__name__}: {exc}") from exc


def _messages(name: str, method: str, messages: Any) -> list[dict[str, Any]]:
    if isinstance(messages, (str, bytes, Mapping)) or not all(
            isinstance(m, Mapping) and isinstance(m.get("role"), str) for m in messages):
        raise EnvironmentError(f"environment {name!r} {method} must return a list of chat messages "
                               f"({{'role': ..., 'content': ...}}), got {messages!r:.200}")
    return [dict(m) for m in messages]


def _schema_name(name: str, schema: Any) -> str:
    from agentloop_core.parsers.base import tool_function

    function = tool_function(schema)
    if function is None or not function.get("name"):
        raise EnvironmentError(f"environment {name!r} tool_schemas() returned {schema!r:.200}; each must be an "
                               "OpenAI tool schema {'type': 'function', 'function': {'name': ..., 'parameters': ...}}")
    return str(function["name"])
