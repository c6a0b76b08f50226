"""The ``http_agent`` loop: train an agent written against the OpenAI API without changing it.

Each trajectory runs the user's agent against its own session URL of an OpenAI-compatible
gateway (:mod:`agentloop_engines.serving.gateway`) over this loop's engine. The gateway records every
call's exact prompt ids, generated ids and log-probs; those calls become the training data
through core's :class:`~agentloop_core.segments.SegmentBuilder`: a call whose prompt extends the
previous prompt plus its generation joins it (mask 1 on generated tokens, 0 on the rest), and a
call that does not (the agent trimmed, summarised or rewrote its context) starts a new segment.
Nothing is decoded and re-encoded for training.

The agent is any callable (or ``"package.module:function"`` import path) called as
``agent(base_url, row)``, sync or async, where ``base_url`` is an OpenAI base URL (give it to
``openai.OpenAI(base_url=..., api_key="unused")`` or ``ChatOpenAI(base_url=...)``; any model name
is accepted) and ``row`` is the dataset row. It may return:

* ``None``: the reward comes from the trainer's scorer (``reward_fn``), as for any loop;
* a number: the trajectory's reward;
* a mapping with ``reward`` (optional) and ``metrics`` (numbers, added to the output's metrics).

A synchronous agent runs on a thread of a pool of its own (``max_sync_agent_threads``, see
:mod:`agentloop_engines.serving.sync_agents`), so a blocking client never stalls the rollout's event
loop, and never holds a thread the engine needs: samples past the pool's size wait for a thread. The gateway's sampling parameters are the trainer's (temperature, top-p, seed...):
what the agent asks for is overridden. ``response_length`` is the budget of each segment: every
call's ``max_tokens`` is capped to what is left of it, and a call with nothing left is refused
(HTTP 400). An agent that then stops with an error ends the trajectory as a length limit ends
any loop's: its calls are trained on, and ``metrics["response_budget_spent"]`` is 1.

With a vision-language model the agent may send images (``image_url`` parts holding data URLs,
in user messages and tool results; see :mod:`agentloop_engines.serving.gateway.images`): the loop's
vision processor renders them, and each segment's ``multi_modal_data`` holds its images in the
order of their tokens. ``max_images``, ``max_image_pixels`` and ``max_image_bytes`` bound them,
and ``allow_remote_image_urls`` lets the gateway fetch ``http(s)`` URLs (off by default); an agent
resends its images on every call, so ``max_request_bytes`` (8 MiB) may need raising too.
"""

from __future__ import annotations

import asyncio
import hashlib
import inspect
import logging
import math
import re
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from agentloop_core.imports import import_object
from agentloop_core.loop import AgentLoopBase
from agentloop_core.output import AgentLoopOutput
from agentloop_core.parsers import DEFAULT_TOOL_PARSER
from agentloop_core.protocol import DEFAULT_RESPONSE_LENGTH, SamplingParams
from agentloop_core.registry import register
from agentloop_core.segments import SegmentBuilder
from agentloop_core.vision import ImageLimits, VisionProcessor
from agentloop_engines.serving.common import DEFAULT_MAX_REQUEST_BYTES
from agentloop_engines.serving.sync_agents import (
    DEFAULT_SYNC_AGENT_THREADS,
    SyncAgentPoolFullError,
    check_threads,
    sync_agent_pool,
)

logger = logging.getLogger(__name__)

_IMAGE_OPTIONS = ("max_images", "max_image_pixels", "max_image_bytes", "allow_remote_image_urls")
"""This loop's image keys: the :class:`~agentloop_engines.serving.gateway.Gateway` options of the same names."""

@dataclass(frozen=True)
class HTTPAgentConfig:
    """What ``http_agent`` reads from the loop config (the trainer's
    ``actor_rollout_ref.rollout.agent`` / ``multi_turn`` sections)."""

    agent: Callable[..., Any]
    """The agent: ``agent(base_url, row)``, sync or async."""
    tool_parser: str | None = DEFAULT_TOOL_PARSER
    """Parser that turns generated text into ``tool_calls`` for requests that send ``tools``."""
    chat_template: str | None = None
    """A Jinja chat template replacing the tokenizer's own."""
    chat_template_kwargs: Mapping[str, Any] | None = None
    """Template variables for every chat request (a request's own win)."""
    timeout_s: float | None = 600.0
    """Wall-clock limit of one agent run; past it the trajectory fails (and is counted)."""
    max_calls: int = 1000
    """Model calls one trajectory may make; the call past it is refused with an error."""
    api_key: str | None = None
    """Bearer token the gateway demands (None: none; it binds to 127.0.0.1 only)."""
    response_length: int = DEFAULT_RESPONSE_LENGTH
    """Token budget of each segment, as every loop's ``response_length``: each call's
    ``max_tokens`` is capped to what is left of it."""
    max_sync_agent_threads: int = DEFAULT_SYNC_AGENT_THREADS
    """Threads that run a synchronous agent, one per running sample (async agents need none);
    more samples than this wait for a thread. Agents that ran past ``timeout_s`` keep theirs
    until they return; with every thread held so, samples fail naming this key."""
    max_images: int = ImageLimits.max_images
    """Most images the agent may send in one conversation (its requests' ``image_url`` parts)."""
    max_image_pixels: int = ImageLimits.max_pixels
    """Most pixels one image may declare (checked on its header, before decoding)."""
    max_image_bytes: int = ImageLimits.max_bytes
    """Most encoded bytes of one image."""
    allow_remote_image_urls: bool = False
    """Whether the gateway fetches ``http(s)`` image URLs the agent sends (off: data URLs only)."""
    allow_special_tokens_in_content: bool = False
    """Encode special-token strings in the agent's messages as the control tokens (vLLM's way);
    off: as text (see ``Gateway(allow_special_tokens_in_content=)``)."""
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    """Largest request body the gateway reads (413 past it). An agent resends its whole
    conversation, images included, on every call: raise it for agents that send many images."""

    @property
    def image_options(self) -> dict[str, Any]:
        """The gateway's image options (it never accepts file paths from an agent)."""
        return {key: getattr(self, key) for key in _IMAGE_OPTIONS}

    @classmethod
    def from_mapping(cls, config: Mapping[str, Any]) -> HTTPAgentConfig:
        """Read and check the loop config.

        The mapping is the rollout's ``loop_mapping`` with this loop's section over it (other
        keys are ignored); the rollout rejects unknown keys of the section itself (through
        :attr:`HTTPAgentLoop.config_class`).

        Raises:
            ValueError: without ``agent``, or for an agent that is not callable or cannot be
                imported.
        """
        agent = config.get("agent")
        if agent is None:
            raise ValueError("http_agent needs config 'agent': a callable agent(base_url, row) or an import "
                             "path 'package.module:function'")
        if isinstance(agent, str):
            agent = import_object(agent, where="http_agent agent")
        if not callable(agent):
            raise ValueError(f"http_agent: agent {agent!r} is not callable; it is called as agent(base_url, row)")
        max_calls = int(config.get("max_calls", 1000))
        if max_calls < 1:
            raise ValueError(f"http_agent: max_calls must be >= 1, got {max_calls}")
        timeout = config.get("timeout_s", 600.0)
        threads = check_threads(config.get("max_sync_agent_threads", DEFAULT_SYNC_AGENT_THREADS))
        remote = config.get("allow_remote_image_urls", False)
        if not isinstance(remote, bool):
            raise ValueError(f"http_agent: allow_remote_image_urls must be true or false, got {remote!r}")
        special = config.get("allow_special_tokens_in_content", False)
        if not isinstance(special, bool):
            raise ValueError(f"http_agent: allow_special_tokens_in_content must be true or false, got {special!r}")
        images = {key: config.get(key, getattr(cls, key)) for key in _IMAGE_OPTIONS[:3]}
        body = config.get("max_request_bytes", DEFAULT_MAX_REQUEST_BYTES)
        # None (a rollout without one) is the default budget, as for every loop config.
        budget = config.get("response_length")
        budget = DEFAULT_RESPONSE_LENGTH if budget is None else budget
        for key, value in (*images.items(), ("max_request_bytes", body), ("response_length", budget)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"http_agent: {key} must be a positive integer, got {value!r}")
        return cls(agent=agent, max_sync_agent_threads=threads, tool_parser=config.get("tool_parser", DEFAULT_TOOL_PARSER),
                   chat_template=config.get("chat_template"),
                   chat_template_kwargs=config.get("chat_template_kwargs"),
                   timeout_s=None if timeout is None else float(timeout), max_calls=max_calls,
                   api_key=config.get("api_key"), response_length=budget,
                   allow_remote_image_urls=remote, max_request_bytes=body,
                   allow_special_tokens_in_content=special, **images)


# One gateway (and its HTTP thread) per event loop, engine, tokenizer and gateway options: loops
# are built once per sample, the gateway outlives them.
_GATEWAYS: dict[tuple, Any] = {}
_GATEWAYS_LOCK = threading.Lock()


def _gateway_for(server: Any, tokenizer: Any, vision: Any, cfg: HTTPAgentConfig,
                 loop: asyncio.AbstractEventLoop) -> Any:
    from agentloop_engines.serving.gateway import Gateway, GatewayThread, SessionRecorder

    key = (id(loop), id(server), id(tokenizer), id(vision), cfg.tool_parser, cfg.chat_template, cfg.api_key,
           cfg.max_calls, repr(sorted((cfg.chat_template_kwargs or {}).items())), repr(cfg.image_options),
           cfg.max_request_bytes, cfg.allow_special_tokens_in_content)
    with _GATEWAYS_LOCK:
        for stale in [k for k, (thread, owner) in _GATEWAYS.items() if owner.is_closed()]:
            _GATEWAYS.pop(stale)[0].__exit__(None, None, None)
        if key not in _GATEWAYS:
            gateway = Gateway(server, tokenizer, chat_template=cfg.chat_template, tool_parser=cfg.tool_parser,
                              chat_template_kwargs=cfg.chat_template_kwargs, server_loop=loop,
                              recorder=SessionRecorder(max_calls_per_session=cfg.max_calls), vision=vision,
                              allow_special_tokens_in_content=cfg.allow_special_tokens_in_content,
                              **cfg.image_options)
            thread = GatewayThread(gateway, api_key=cfg.api_key, max_request_bytes=cfg.max_request_bytes)
            _GATEWAYS[key] = (thread.__enter__(), loop)
        return _GATEWAYS[key][0]


def close_gateways() -> None:
    """Stop every gateway ``http_agent`` started in this process (tests, shutdown)."""
    with _GATEWAYS_LOCK:
        while _GATEWAYS:
            _GATEWAYS.popitem()[1][0].__exit__(None, None, None)


def _training_overrides(sampling_params: Mapping[str, Any] | SamplingParams, cap: int | None) -> dict[str, Any]:
    params = sampling_params.as_dict() if isinstance(sampling_params, SamplingParams) else dict(sampling_params)
    params = {k: v for k, v in params.items() if v is not None}
    max_tokens = params.pop("max_tokens", None)
    limits = [n for n in (max_tokens, cap) if n is not None]
    if limits:
        params["max_tokens"] = int(min(limits))
    params["logprobs"] = True
    return params


@register("http_agent")
class HTTPAgentLoop(AgentLoopBase):
    """Runs a user's OpenAI-API agent against a recording session; see the module docstring."""

    config_class = HTTPAgentConfig

    def __init__(self, server: Any, tokenizer: Any, config: HTTPAgentConfig | Mapping[str, Any] | None = None,
                 processor: Any = None, tracer: Any = None) -> None:
        super().__init__(server, tokenizer, config, processor, tracer)
        self.config: HTTPAgentConfig

    async def run(self, sampling_params: Mapping[str, Any] | SamplingParams, **row: Any) -> list[AgentLoopOutput]:
        """Run the agent once; return the trajectory's segments.

        Raises:
            ValueError: when the agent made no model call through its base URL, or returned
                something other than None, a number or a mapping.
            TimeoutError: past ``timeout_s``.
        """
        cfg = self.config
        thread = _gateway_for(self.server, *self._tokenizer_and_vision(), cfg, asyncio.get_running_loop())
        session_id = session_id_for(row.get("index"))
        thread.gateway.open_session(session_id, sampling_overrides=_training_overrides(sampling_params,
                                                                                        cfg.response_length),
                                    response_length=cfg.response_length)
        start = time.perf_counter()
        budget_spent = False
        try:
            with self.tracer.span("http_agent", request_id=session_id):
                result = await self._call_agent(thread.session_url(session_id), row)
        except Exception:
            # The gateway refused a call because the segment's response budget was used up; the
            # agent could not go on, which ends the trajectory as a length limit ends any loop's.
            if not thread.gateway.recorder.exhausted(session_id):
                raise
            result, budget_spent = None, True
        finally:
            calls = thread.gateway.close_session(session_id)
        agent_s = time.perf_counter() - start
        if not calls:
            raise ValueError(
                f"http_agent: the agent made no model call through its base_url (session {session_id}); it must "
                "send its requests to the base_url it is given (openai.OpenAI(base_url=base_url, ...))")
        reward, metrics = _interpret(result)
        builder = SegmentBuilder()
        # A segment's images are those of its last call: each call's prompt extends the one before.
        images: dict[int, tuple[Any, ...]] = {}
        for call in calls:
            images[builder.add_call(call.prompt_ids, call.token_ids, call.log_probs, call.stop_reason)] = call.images
        generated = sum(len(call.token_ids) for call in calls)
        metrics = {**metrics, "http_calls": len(calls), "agent_s": agent_s, "generated_tokens": generated,
                   "segments": builder.num_segments, "response_budget_spent": int(budget_spent)}
        outputs = builder.outputs(reward_score=reward, num_turns=len(calls), metrics=metrics,
                                  extra_fields={"session_id": session_id, "row_index": row.get("index")})
        return [replace(out, multi_modal_data={"image": list(images[k])}) if images[k] else out
                for k, out in enumerate(outputs)]

    def _tokenizer_and_vision(self) -> tuple[Any, Any]:
        """What the gateway renders with: the tokenizer, and the loop's vision processor (or
        ``"auto"``: the gateway loads it from the tokenizer's folder). A Hugging Face processor
        given as ``processor`` renders itself, as before vision processors existed."""
        if isinstance(self.processor, VisionProcessor):
            return self.tokenizer, self.processor
        if self.processor is not None and hasattr(self.processor, "apply_chat_template"):
            return self.processor, "auto"
        return self.tokenizer, "auto"

    async def _call_agent(self, base_url: str, row: Mapping[str, Any]) -> Any:
        cfg = self.config
        agent = cfg.agent
        if inspect.iscoroutinefunction(agent) or inspect.iscoroutinefunction(type(agent).__call__):
            return await asyncio.wait_for(agent(base_url, dict(row)), cfg.timeout_s)
        # A blocking client on this loop would deadlock the gateway, which runs generate here;
        # on the default executor it would hold the threads the engine's compute may need.
        pool = sync_agent_pool(cfg.max_sync_agent_threads)
        result = await pool.run(agent, base_url, dict(row), timeout_s=cfg.timeout_s)
        if inspect.isawaitable(result):
            return await asyncio.wait_for(result, cfg.timeout_s)
        return result


_UNSAFE = re.compile(r"[^A-Za-z0-9._~-]+")
_READABLE_CHARS = 32


def session_id_for(index: Any) -> str:
    """A fresh session id for one sample of the row whose ``index`` is given (any value).

    The id is ``<readable>-<digest>-<random>``: up to 32 characters of the index with anything
    but ``A-Z a-z 0-9 . _ ~ -`` replaced by ``_`` (``row`` when nothing is left), 12 hex digits
    of the SHA-256 of the index's ``repr`` (so rows whose readable parts agree still differ),
    and 16 random hex digits (so the samples of one row differ). It is never longer than 63
    characters, so nothing unique is truncated away, and it is always a valid URL path segment
    and engine request id. The index itself goes to the output's ``extra_fields["row_index"]``.
    """
    text = index if isinstance(index, str) else str(index)
    readable = _UNSAFE.sub("_", text[: 4 * _READABLE_CHARS])[:_READABLE_CHARS] if index is not None else ""
    digest = hashlib.sha256(repr(index).encode("utf-8", "backslashreplace")).hexdigest()[:12]
    return f"{readable or 'row'}-{digest}-{uuid.uuid4().hex[:16]}"


def _interpret(result: Any) -> tuple[float | None, dict[str, float]]:
    """(reward, metrics) from what the agent returned."""
    if result is None:
        return None, {}
    if isinstance(result, bool) or not isinstance(result, (int, float, Mapping)):
        raise ValueError(f"http_agent: the agent returned {type(result).__name__}; return None, a number (the "
                         "reward) or a mapping with 'reward' and/or 'metrics'")
    if not isinstance(result, Mapping):
        reward: Any = result
        metrics: Any = {}
    else:
        unknown = sorted(set(result) - {"reward", "metrics"})
        if unknown:
            raise ValueError(f"http_agent: the agent's result has unknown keys {unknown}; use 'reward' and 'metrics'")
        reward, metrics = result.get("reward"), result.get("metrics") or {}
    if reward is not None:
        reward = float(reward)
        if not math.isfinite(reward):
            raise ValueError(f"http_agent: the agent returned a non-finite reward {reward}")
    if not isinstance(metrics, Mapping) or not all(isinstance(v, (int, float)) for v in metrics.values()):
        raise ValueError(f"http_agent: 'metrics' must map names to numbers, got {metrics!r}")
    return reward, {str(k): float(v) for k, v in metrics.items()}


__all__ = ["HTTPAgentConfig", "HTTPAgentLoop", "SyncAgentPoolFullError", "close_gateways", "session_id_for",
           "sync_agent_pool"]
