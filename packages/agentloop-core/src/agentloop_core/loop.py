"""The base class every agent loop implements."""

from __future__ import annotations

import abc
from collections.abc import Mapping
from typing import Any, ClassVar

from agentloop_core.output import AgentLoopOutput
from agentloop_core.protocol import AsyncServer


class AgentLoopBase(abc.ABC):
    """One rollout strategy (single turn, tool use, a LangGraph agent...).

    A loop is constructed once per sample by the worker and talks to its server only through
    ``self.server.generate(request_id, prompt_ids, sampling_params)``.

    Args:
        server: An engine adapter (``HFServer``...), or a client in front of several replicas.
        tokenizer: A Hugging Face tokenizer with a chat template.
        config: Loop options (``prompt_length``, ``response_length``, loop-specific keys).
        processor: A multimodal processor, when the model has one.
        tracer: Rollout tracer for spans; see :mod:`agentloop_core.tracing`.
    """

    agent_name: ClassVar[str] = ""

    def __init__(
        self,
        server: AsyncServer,
        tokenizer: Any,
        config: Mapping[str, Any] | None = None,
        processor: Any = None,
        tracer: Any = None,
    ) -> None:
        self.server = server
        self.tokenizer = tokenizer
        self.config: dict[str, Any] = dict(config or {})
        self.processor = processor
        if tracer is None:
            from agentloop_core.tracing import NullTracer

            tracer = NullTracer()
        self.tracer = tracer

    @abc.abstractmethod
    async def run(
        self, sampling_params: Mapping[str, Any], **row: Any
    ) -> AgentLoopOutput | list[AgentLoopOutput]:
        """Roll out one sample.

        Args:
            sampling_params: Sampling parameters for every ``generate`` call.
            **row: The dataset row: ``raw_prompt`` (chat messages), ``tools_kwargs``,
                ``index``, ground truth and anything else the loop needs.

        Returns:
            The trajectory as token ids with its response mask; or, when its calls' prompts do
            not extend each other (the agent rewrote its context), its segments in call order,
            as :class:`~agentloop_core.segments.SegmentBuilder` makes them. The segments share
            one reward: the last segment's ``reward_score``.
        """
