"""One rollout worker: runs a chunk of samples as concurrent asyncio tasks."""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Mapping, Sequence
from typing import Any

from agentloop_core.output import AgentLoopOutput
from agentloop_core.protocol import AsyncServer, SamplingParams
from agentloop_core.registry import get_agent_loop_class
from agentloop_core.runtime.config import resolve_agent_names
from agentloop_core.runtime.gc_hold import GC_HOLD
from agentloop_core.runtime.pacing import PacedServer, TurnPacer, use_pacer
from agentloop_core.runtime.seeding import SeededServer, sample_seed_scope
from agentloop_core.runtime.sessions import SessionRecordingServer, forgets_sessions, trajectory_sessions
from agentloop_core.runtime.switch_interval import SWITCH_INTERVAL
from agentloop_core.segments import trajectory_reward, trajectory_view
from agentloop_core.settings import RolloutConfig
from agentloop_core.tracing import Tracer, make_tracer, trace_context
from agentloop_core.vision.processor import load_vision_processor

logger = logging.getLogger(__name__)


class SampleTimeoutError(TimeoutError):
    """A sample ran longer than ``sample_timeout_s``."""


class AgentLoopWorker:
    """Runs agent loops for a list of dataset rows, one asyncio task per sample.

    Args:
        server: The engine, or a client in front of several replicas. Used from this worker's
            event loop only. To run the worker as a Ray actor it must pickle (a scripted server,
            or a client that holds Ray actor handles).
        tokenizer: A Hugging Face tokenizer, or a path/hub id loaded lazily with
            ``AutoTokenizer.from_pretrained`` on first use (cheap to send to a Ray actor); the
            one loaded from a path gets ``config.custom_chat_template``. A tokenizer object is
            used as it is.
        config: The rollout's :class:`~agentloop_core.settings.RolloutConfig` (a mapping from a
            script of its own is converted with ``RolloutConfig.from_mapping`` here). Each loop
            is built with ``config.loop_config(name, cls)``, made once per loop name.
        tracer: A :class:`~agentloop_core.tracing.Tracer`, or a config for
            :func:`~agentloop_core.tracing.make_tracer`. None: no tracing.
        processor: The model's :class:`~agentloop_core.vision.VisionProcessor`, when it has
            one. None with a tokenizer path: loaded from that folder with the tokenizer
            (:func:`~agentloop_core.vision.load_vision_processor`; None for a text model).
    """

    def __init__(
        self,
        server: AsyncServer,
        tokenizer: Any,
        config: RolloutConfig | Mapping[str, Any] | None = None,
        tracer: Tracer | Mapping[str, Any] | None = None,
        processor: Any = None,
    ) -> None:
        self.server = server
        self.config = RolloutConfig.of(config)
        self.tracer = make_tracer(tracer)
        self.processor = processor
        if isinstance(tokenizer, (str, os.PathLike)):
            self._tokenizer_path: str | None = os.fspath(tokenizer)
            self._tokenizer = None
        else:
            self._tokenizer_path = None
            self._tokenizer = tokenizer
        self.config.register_loops()
        self.reward_fn = self.config.reward_fn
        # One config per loop name, built once, not per sample.
        self._loop_configs: dict[str, Any] = {}
        self.turns_per_loop_iteration: int | None = self.config.turns_per_loop_iteration
        seed = self.config.sampling_seed
        # Engines that keep state per trajectory hear when one is over (runtime.sessions).
        self._forgets = forgets_sessions(server)
        recorded: AsyncServer = SessionRecordingServer(server) if self._forgets else server
        # What loops call: the server itself, or wrappers noting request ids and adding seeds.
        self.loop_server: AsyncServer = recorded if seed is None else SeededServer(recorded, seed)

    @property
    def tokenizer(self) -> Any:
        """The tokenizer, loaded on first use when the worker was given a path."""
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            from agentloop_core.tokenization.builtin_templates import set_chat_template

            tokenizer = AutoTokenizer.from_pretrained(self._tokenizer_path)
            self._tokenizer = set_chat_template(tokenizer, self.config.custom_chat_template)
            if self.processor is None and self._tokenizer_path is not None:
                self.processor = load_vision_processor(self._tokenizer_path, self._tokenizer)
        return self._tokenizer

    def sampling_params(self, validate: bool = False) -> SamplingParams:
        """The sampling parameters for a batch: ``val_sampling_params`` when ``validate`` (and
        set), else ``sampling_params``."""
        return self.config.sampling_for(validate)

    async def generate_sequences(
        self,
        rows: Sequence[Mapping[str, Any]],
        *,
        validate: bool = False,
        step: int | None = None,
        sample_offset: int = 0,
    ) -> list[AgentLoopOutput]:
        """Roll out every row concurrently.

        A loop that raises, or runs past ``sample_timeout_s``, does not stop the others: its
        sample comes back as one :meth:`AgentLoopOutput.failure` with the error in ``metrics``.

        Args:
            rows: Dataset rows; each names its loop by ``agent_name`` and is passed to the
                loop's ``run`` as keyword arguments.
            validate: Use the validation sampling parameters.
            step: Training step, for trace tags.
            sample_offset: Index of ``rows[0]`` in the whole batch, for trace tags and errors.

        Returns:
            The outputs of every row, rows in input order: one per row, or a row's segments
            in order when its loop returned several. Each carries ``trajectory_index`` (the
            row's index in the whole batch, ``sample_offset + i``) and ``segment_index``; all
            segments of a trajectory carry its reward, ``agent_name``, ``agent_loop_s`` and
            ``reward_s``.

        Raises:
            ValueError: a row has no ``agent_name`` and there is no ``default_agent_loop``.
            UnknownAgentLoopError: a row names a loop that is not registered.
        """
        names = resolve_agent_names(rows, self.config.default_agent_loop, sample_offset)
        classes = {name: get_agent_loop_class(name) for name in set(names)}
        sampling_params = self.sampling_params(validate)
        timeout = self.config.sample_timeout_s
        limit = self.config.max_concurrent_samples
        semaphore = asyncio.Semaphore(limit) if limit else None
        tokenizer = self.tokenizer  # load once, before thousands of tasks ask for it
        pace = self.turns_per_loop_iteration
        pacer = TurnPacer(pace) if pace else None
        server = PacedServer(self.loop_server, pacer) if pacer else self.loop_server

        async def one(i: int, row: Mapping[str, Any]) -> list[AgentLoopOutput]:
            index = sample_offset + i
            name = names[i]
            # Row ids are stable across chunkings; batch positions are too (sample_offset is global).
            rid = row.get("request_id")
            seed_key = f"step={step}/validate={validate}/" + (f"request={rid}" if rid else f"sample={index}")
            start = time.perf_counter()
            use_pacer(pacer)  # this sample's task only (gather runs each in its own context)
            tags = trace_context(step=step, sample_index=index, rollout_n=row.get("rollout_n", 0), validate=validate)
            with tags, sample_seed_scope(seed_key), trajectory_sessions(self.server if self._forgets else None):
                try:
                    if semaphore is not None:
                        async with semaphore:
                            segments = await self._run_one(
                                classes[name], name, tokenizer, sampling_params, row, timeout, server, pacer
                            )
                    else:
                        segments = await self._run_one(
                            classes[name], name, tokenizer, sampling_params, row, timeout, server, pacer
                        )
                    if not any(s.failed for s in segments):
                        await self._score(segments, row, tokenizer)
                except Exception as exc:  # noqa: BLE001 - one bad sample must not kill the batch
                    logger.warning(
                        "sample %d (agent %r) failed: %s: %s", index, name, type(exc).__name__, exc
                    )
                    segments = [AgentLoopOutput.failure(None, exc, sample_index=index)]
            # A failed trajectory is one failed output, whatever segments it had, so failures
            # are counted per sample as before.
            failed = [s for s in segments if s.failed]
            if failed:
                segments = failed[:1]
            elapsed = time.perf_counter() - start
            for k, output in enumerate(segments):
                output.trajectory_index = index
                output.segment_index = k
                output.metrics.setdefault("agent_name", name)
                output.metrics["agent_loop_s"] = elapsed
            return segments

        try:
            with GC_HOLD.holding(self.config.hold_full_gc), SWITCH_INTERVAL.holding(self.config.switch_interval_s):
                parts = await asyncio.gather(*(one(i, row) for i, row in enumerate(rows)))
        finally:
            self.tracer.flush()
        return [output for part in parts for output in part]

    async def _score(self, segments: list[AgentLoopOutput], row: Mapping[str, Any], tokenizer: Any) -> None:
        """Give every segment the trajectory's reward: ``reward_fn`` once on the trajectory,
        or the loop's own reward (the last segment's) when there is no ``reward_fn``."""
        if self.reward_fn is None:
            reward = trajectory_reward(segments)
            for output in segments:
                output.reward_score = reward
            return
        view = trajectory_view(segments)
        before = dict(view.metrics)
        reward_start = time.perf_counter()
        await self.reward_fn(view, row, tokenizer)
        view.metrics["reward_s"] = time.perf_counter() - reward_start
        if len(segments) == 1:
            return  # the view is the segment itself
        added = {k: v for k, v in view.metrics.items() if k not in before or before[k] is not v}
        for output in segments:
            output.reward_score = view.reward_score
            output.metrics.update(added)

    def loop_config(self, name: str) -> Any:
        """The config loop ``name`` is built with (see ``RolloutConfig.loop_config``), made once
        per name: its typed config, or for a loop without a config class a dict."""
        config = self._loop_configs.get(name)
        if config is None:
            config = self._loop_configs[name] = self.config.loop_config(name, get_agent_loop_class(name))
        return config

    async def _run_one(
        self,
        cls: type,
        name: str,
        tokenizer: Any,
        sampling_params: SamplingParams,
        row: Mapping[str, Any],
        timeout: float | None,
        server: AsyncServer,
        pacer: TurnPacer | None,
    ) -> list[AgentLoopOutput]:
        if pacer is not None:  # building the loop and its first render are this sample's first turn
            await pacer.wait()
        with self.tracer.span("agent_loop", agent_name=name) as span:
            loop = cls(
                server=server,
                tokenizer=tokenizer,
                config=self.loop_config(name),
                processor=self.processor,
                tracer=self.tracer,
            )
            coro = loop.run(sampling_params, **row)
            if not timeout:
                output = await coro
            else:
                start = time.perf_counter()
                try:
                    output = await asyncio.wait_for(coro, timeout)
                except asyncio.TimeoutError as exc:
                    # A TimeoutError from inside the loop (a tool's own limit) is not ours to rename.
                    if time.perf_counter() - start < timeout:
                        raise
                    raise SampleTimeoutError(
                        f"sample ran longer than sample_timeout_s={timeout}; raise it or set it to None"
                    ) from exc
            if self.tracer.token2text:
                _trace_text(span, output, tokenizer)
        if isinstance(output, AgentLoopOutput):
            return [output]
        if isinstance(output, (list, tuple)) and all(isinstance(o, AgentLoopOutput) for o in output):
            if not output:
                raise ValueError(
                    f"agent loop {name!r} returned an empty list; return at least one AgentLoopOutput "
                    "(or raise, and the sample is counted as failed)"
                )
            return list(output)
        what = type(output).__name__
        if isinstance(output, (list, tuple)):
            what += " of " + ", ".join(sorted({type(o).__name__ for o in output}))
        raise TypeError(
            f"agent loop {name!r} returned {what}; run() must return an AgentLoopOutput or a list "
            "of them (the segments of one trajectory, see agentloop_core.segments)"
        )


def _trace_text(span: dict[str, Any], output: Any, tokenizer: Any) -> None:
    """The trajectory's prompt and response as text on its root span (``Tracer.token2text``);
    a trajectory of several segments gets each segment's response."""
    if isinstance(output, AgentLoopOutput):
        segments = [output]
    else:  # a malformed return is reported after the span closes
        segments = [o for o in output if isinstance(o, AgentLoopOutput)] if isinstance(output, (list, tuple)) else []
    if not segments:
        return
    span["prompt_text"] = tokenizer.decode(list(segments[0].prompt_ids), skip_special_tokens=False)
    texts = [tokenizer.decode(list(o.response_ids), skip_special_tokens=False) for o in segments]
    span["response_text"] = texts[0] if len(texts) == 1 else texts
