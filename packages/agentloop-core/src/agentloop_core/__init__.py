"""agentloop-core: the protocol every agentloop package builds on.

Importing this package never imports torch, ray or mlflow; the modules that need them import
them on use.
"""

from importlib.metadata import version as _distribution_version

from agentloop_core.batch import RolloutBatch, SequenceTooLongError
from agentloop_core.engine_registry import EngineCapabilities, EngineConfig, EnginePlugin, UnknownEngineError
from agentloop_core.loop import AgentLoopBase
from agentloop_core.output import AgentLoopOutput
from agentloop_core.protocol import (
    DEFAULT_RESPONSE_LENGTH,
    AsyncServer,
    CapabilityNotSupportedError,
    SamplingParams,
    ServerCapabilities,
    StopReason,
    TokenOutput,
)
from agentloop_core.registry import (
    UnknownAgentLoopError,
    get_agent_loop_class,
    register,
    registered_names,
)
from agentloop_core.runtime import AgentLoopManager, AgentLoopWorker, SampleTimeoutError, turn_slot
from agentloop_core.segments import SegmentBuilder
from agentloop_core.settings import RolloutConfig
from agentloop_core.single_turn import SingleTurnAgentLoop
from agentloop_core.tokenization import (
    ChatRenderer,
    SanityCheckMode,
    SanityCheckReport,
    TokenizationMismatchError,
    Trajectory,
)
from agentloop_core.tracing import NullTracer, Tracer, make_tracer, trace_context
from agentloop_core.tracing.jsonl import JsonlTracer
from agentloop_core.tracing.mlflow import MLflowTracer

__version__ = _distribution_version("agentloop-core")
"""The installed distribution's version: pyproject.toml is its one source."""

__all__ = [
    "__version__",
    "DEFAULT_RESPONSE_LENGTH",
    "AgentLoopBase",
    "AgentLoopManager",
    "AgentLoopOutput",
    "AgentLoopWorker",
    "AsyncServer",
    "CapabilityNotSupportedError",
    "ChatRenderer",
    "EngineCapabilities",
    "EngineConfig",
    "EnginePlugin",
    "JsonlTracer",
    "MLflowTracer",
    "NullTracer",
    "RolloutBatch",
    "RolloutConfig",
    "SampleTimeoutError",
    "SamplingParams",
    "SanityCheckMode",
    "SanityCheckReport",
    "SegmentBuilder",
    "SequenceTooLongError",
    "ServerCapabilities",
    "SingleTurnAgentLoop",
    "StopReason",
    "TokenOutput",
    "TokenizationMismatchError",
    "Tracer",
    "Trajectory",
    "UnknownAgentLoopError",
    "UnknownEngineError",
    "get_agent_loop_class",
    "make_tracer",
    "register",
    "registered_names",
    "trace_context",
    "turn_slot",
]

