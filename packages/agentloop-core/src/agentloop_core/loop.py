"""The base class every agent loop implements."""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Mapping
from typing import Any, ClassVar

from agentloop_core.output import AgentLoopOutput
from agentloop_core.protocol import AsyncServer, SamplingParams


class AgentLoopBase(abc.ABC):
    """One rollout strategy (single turn, tool use, a LangGraph agent...).

    A loop is constructed once per sample by the worker and talks to its server only through
    ``self.server.generate(request_id, prompt_ids, sampling_params)``.

    A loop with typed options sets ``config_class``: a frozen dataclass with a classmethod
    ``from_mapping(mapping)`` that reads its fields from a mapping and ignores other keys. The
    rollout then builds that object once per loop name (the trainer at start-up, so a bad key
    fails there; see :meth:`~agentloop_core.settings.RolloutConfig.with_loop_configs`) and
    passes it as ``config``; ``self.config`` holds it. A loop without one gets a dict there.

    Args:
        server: An engine adapter (``HFServer``...), or a client in front of several replicas.
        tokenizer: A Hugging Face tokenizer with a chat template.
        config: The loop's ``config_class`` instance, or a mapping of options
            (``prompt_length``, ``response_length``, ``sanity_check``, loop-specific keys),
            read into ``config_class`` when the loop has one.
        processor: A multimodal processor, when the model has one.
        tracer: Rollout tracer for spans; see :mod:`agentloop_core.tracing`.
    """

    agent_name: ClassVar[str] = ""
    config_class: ClassVar[type | None] = None
    """The loop's typed config (see the class docstring); None: the loop reads a dict."""

    def __init__(
        self,
        server: AsyncServer,
        tokenizer: Any,
        config: Any = None,
        processor: Any = None,
        tracer: Any = None,
    ) -> None:
        self.server = server
        self.tokenizer = tokenizer
        cls = type(self).config_class
        if cls is None:
            config = dict(config or {})
        elif not isinstance(config, cls):
            config = build_loop_config(cls, dict(config or {}))
        # One attribute, named as the constructor argument and ``config_class`` are: a second
        # name for the same object (``settings``, promised by no release) let a subclass
        # replace one and go on reading the other.
        self.config: Any = config
        """The loop's options: its ``config_class`` instance, or a dict for a loop without one."""
        self.processor = processor
        if tracer is None:
            from agentloop_core.tracing import NullTracer

            tracer = NullTracer()
        self.tracer = tracer

    @abc.abstractmethod
    async def run(
        self, sampling_params: SamplingParams | Mapping[str, Any], **row: Any
    ) -> AgentLoopOutput | list[AgentLoopOutput]:
        """Roll out one sample.

        Args:
            sampling_params: Sampling parameters for every ``generate`` call: the rollout's
                :class:`~agentloop_core.protocol.SamplingParams` (``max_tokens`` is the
                per-turn cap); a loop called directly may get a mapping.
            **row: The dataset row: ``raw_prompt`` (chat messages), ``tools_kwargs``,
                ``index``, ground truth and anything else the loop needs.

        Returns:
            The trajectory as token ids with its response mask; or, when its calls' prompts do
            not extend each other (the agent rewrote its context), its segments in call order,
            as :class:`~agentloop_core.segments.SegmentBuilder` makes them. The segments share
            one reward: the last segment's ``reward_score``.
        """


def build_loop_config(config_class: type, mapping: Mapping[str, Any]) -> Any:
    """``config_class.from_mapping(mapping)``; for a dataclass without ``from_mapping``, its
    fields read from ``mapping`` (other keys ignored).

    Raises:
        TypeError: ``config_class`` has no ``from_mapping`` and is not a dataclass.
    """
    reader = getattr(config_class, "from_mapping", None)
    if reader is not None:
        return reader(mapping)
    require_dataclass(config_class)
    return config_class(**{f.name: mapping[f.name] for f in dataclasses.fields(config_class) if f.name in mapping})


def require_dataclass(config_class: Any) -> None:
    """Raise TypeError unless ``config_class`` is a dataclass type."""
    if not (isinstance(config_class, type) and dataclasses.is_dataclass(config_class)):
        raise TypeError(f"config_class must be a dataclass type, got {config_class!r}")
